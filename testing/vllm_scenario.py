"""The encoder-cache scenario through a real ``vllm.LLM``, with and without ecoffload.

More distinct images than vLLM's own encoder cache keeps, one request each,
then the first images again. Without a connector vLLM re-runs the encoder
for them; with ecoffload they come back from the arena. Each run happens in a
fresh child process (vLLM keeps process-global connector state), on the
embedded default: a tiny random PaliGemma built locally, on the CPU (or on
the GPU when vLLM there is a CUDA build).

    python -m ecoffload.testing.vllm_scenario --connector [--multiprocess]

prints one JSON object: generated token ids per request, encoder runs,
the connector's counters, time per request. Several instances can share
one arena (``--arena-name``): e.g. an ``ec_producer`` that keeps running
(``--hold-until FILE``) while an ``ec_consumer`` serves its images, or an
``ec_both`` instance restarted on a ``--persistent`` arena.

Between hosts (``--nixl '{"host": "127.0.0.1"}'``): a producer prints each
request's ``ec_transfer_params`` in its result; a consumer given them
(``--transfer-params FILE``, a JSON list in request order) sends each request
with ``SamplingParams(extra_args={"ec_transfer_params": ...})``, as a
disaggregation proxy does, and pulls the items from the producer's arena.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from ..connector import cpu_build
from .tiny_vlm import NUM_IMAGE_TOKENS, build_tiny_paligemma

DEFAULT_IMAGES = 6
DEFAULT_REPEATS = 2
# vLLM's encoder cache holds max(max_num_batched_tokens, one item) embeddings:
# 128 tokens = 2 tiny-PaliGemma images.
MAX_NUM_BATCHED_TOKENS = 2 * NUM_IMAGE_TOKENS


@dataclass
class ScenarioResult:
    connector: bool
    multiprocess: bool
    requests: list[int] = field(default_factory=list)  # image index of each request
    token_ids: list[list[int]] = field(default_factory=list)
    encoder_runs: list[int] = field(default_factory=list)  # per request
    seconds: list[float] = field(default_factory=list)  # per request
    connector_stats: dict[str, int] = field(default_factory=dict)  # the worker's
    role: str = "ec_both"
    # The scheduler side after the last request (one-process mode only: the
    # scheduler lives in this process): its counters, items still being
    # written, pins held.
    scheduler_stats: dict[str, float] = field(default_factory=dict)
    writing_after: int | None = None
    pinned_after: int | None = None
    load_seconds: float = 0.0
    ec_transfer_params: list = field(default_factory=list)  # per request (a producer's)


def count_encoder_runs(worker: Any) -> int:
    """collective_rpc target: count items the encoder produced on this worker from now on.

    Wraps the model's ``embed_multimodal`` (vLLM's multimodal model interface,
    called by every model runner, V1 and V2, once per encoder batch) and
    counts the items it returns; no runner internals are touched.
    """
    model = worker.get_model()
    if not hasattr(model, "_ecoffload_encoder_runs"):
        model._ecoffload_encoder_runs = 0
        original = model.embed_multimodal

        def counted(*args: Any, **kwargs: Any) -> Any:
            outputs = original(*args, **kwargs)
            model._ecoffload_encoder_runs += len(outputs)
            return outputs

        model.embed_multimodal = counted
    return model._ecoffload_encoder_runs


def connector_counts(worker: Any) -> dict[str, int]:
    """collective_rpc target: the worker-side connector's counters."""
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

    return cast(Any, get_ec_transfer()).side.stats() if has_ec_transfer() else {}


def ec_transfer_config(
    arena_dir: str,
    *,
    arena_name: str | None = None,
    role: str = "ec_both",
    persistent: bool = False,
    nixl: dict[str, Any] | None = None,
    cluster: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The scenario's connector config: a 16 MiB arena of 16 KiB blocks."""
    extra: dict[str, Any] = {"arena_bytes": "16MiB", "block_bytes": "16KiB", "arena_dir": arena_dir}
    if arena_name is not None:
        extra["arena_name"] = arena_name
    if persistent:
        extra["persistent"] = True
    if nixl is not None:
        extra["nixl"] = nixl
    if cluster is not None:
        extra["cluster"] = cluster
    return {
        "ec_connector": "ECOffloadConnector",
        "ec_connector_module_path": "ecoffload.connector",
        "ec_role": role,
        "ec_connector_extra_config": extra,
    }


def in_process_scheduler_connector(llm: Any) -> Any:
    """The scheduler's connector when the engine core runs in this process, else None."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    return scheduler.get_ec_connector() if scheduler is not None else None


def make_images(n: int, size: int = 112) -> list:
    """n distinct deterministic RGB images: three solid colours, then noise."""
    import numpy as np
    from PIL import Image

    solids = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    images = [Image.new("RGB", (size, size), c) for c in solids[: min(n, 3)]]
    for i in range(len(images), n):
        pixels = np.random.default_rng(1000 + i).integers(0, 256, (size, size, 3), np.uint8)
        images.append(Image.fromarray(pixels, "RGB"))
    return images


def run_here(
    *,
    connector: bool,
    multiprocess: bool,
    model_dir: str,
    arena_dir: str,
    images: int = DEFAULT_IMAGES,
    repeats: int = DEFAULT_REPEATS,
    order: list[int] | None = None,
    role: str = "ec_both",
    arena_name: str | None = None,
    persistent: bool = False,
    nixl: dict[str, Any] | None = None,
    transfer_params: list | None = None,
) -> tuple[ScenarioResult, Any]:
    """Run the scenario in this process (call through :func:`run` for a fresh one);
    returns the result and the ``LLM`` (still running)."""
    cpu_build.install()  # multimodal models without torchvision, here and in vLLM's children
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(
        model=model_dir,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=2,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        limit_mm_per_prompt={"image": 1},
        enable_prefix_caching=False,  # or the KV prefix cache hides repeats
        seed=0,
    )
    if connector:
        kwargs["ec_transfer_config"] = ec_transfer_config(
            arena_dir, arena_name=arena_name, role=role, persistent=persistent, nixl=nixl
        )
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    result = ScenarioResult(
        connector, multiprocess, role=role, load_seconds=time.perf_counter() - t0
    )
    order = [*range(images), *range(repeats)] if order is None else order
    pictures = make_images(max(order, default=-1) + 1)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = llm.collective_rpc(count_encoder_runs)[0]
    for i, index in enumerate(order):
        prompt = {"prompt": "describe", "multi_modal_data": {"image": pictures[index]}}
        params = greedy
        if transfer_params is not None and transfer_params[i] is not None:
            # What a disaggregation proxy does: the producer's answer rides along.
            extra = {"ec_transfer_params": transfer_params[i]}
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                    extra_args=extra)  # fmt: skip
        t0 = time.perf_counter()
        (out,) = llm.generate(cast(Any, [prompt]), params, use_tqdm=False)
        result.ec_transfer_params.append(out.ec_transfer_params)
        result.seconds.append(time.perf_counter() - t0)
        runs = llm.collective_rpc(count_encoder_runs)[0]
        result.requests.append(index)
        result.token_ids.append(list(out.outputs[0].token_ids))
        result.encoder_runs.append(runs - before)
        before = runs
    if connector:
        result.connector_stats = llm.collective_rpc(connector_counts)[0]
        scheduler = in_process_scheduler_connector(llm)
        if scheduler is not None:
            result.scheduler_stats = scheduler.side.stats()
            entries = scheduler.side.catalog.entries()
            result.writing_after = sum(e.state.value == "writing" for e in entries)
            result.pinned_after = sum(e.pins for e in entries)
    return result, llm


def _command(
    *,
    connector: bool,
    multiprocess: bool,
    model_dir: str,
    arena_dir: str,
    order: list[int] | None = None,
    role: str = "ec_both",
    arena_name: str | None = None,
    persistent: bool = False,
    hold_until: str | None = None,
    nixl: dict[str, Any] | None = None,
    transfer_params: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # collective_rpc of our counters
        PYTHONSAFEPATH="1",  # never import the repository's kernels/ as `kernels`
    )
    cmd = [sys.executable, "-m", "ecoffload.testing.vllm_scenario", "--json",
           "--model-dir", model_dir, "--arena-dir", arena_dir, "--role", role]  # fmt: skip
    for flag, on in (("--connector", connector), ("--multiprocess", multiprocess),
                     ("--persistent", persistent)):  # fmt: skip
        if on:
            cmd.append(flag)
    if order is not None:
        cmd += ["--order", ",".join(map(str, order))]
    if arena_name is not None:
        cmd += ["--arena-name", arena_name]
    if hold_until is not None:
        cmd += ["--hold-until", hold_until]
    if nixl is not None:
        cmd += ["--nixl", json.dumps(nixl)]
    if transfer_params is not None:
        cmd += ["--transfer-params", transfer_params]
    return cmd, env


def run(
    *,
    connector: bool,
    multiprocess: bool = False,
    model_dir: str | None = None,
    arena_dir: str | None = None,
    timeout_s: float = 600,
    **options: Any,
) -> ScenarioResult:
    """Run the scenario in a fresh Python process and return its result.

    ``options``: ``order`` (image indices to request), ``role``, ``arena_name``,
    ``persistent``, ``nixl`` (see :func:`run_here`), ``transfer_params`` (a JSON
    file: a list of ``ec_transfer_params``, one per request).
    """
    with tempfile.TemporaryDirectory(prefix="ecoffload-scenario-") as tmp:
        model_dir = model_dir or build_tiny_paligemma(os.path.join(tmp, "model"))
        cmd, env = _command(connector=connector, multiprocess=multiprocess, model_dir=model_dir,
                            arena_dir=arena_dir or tmp, **options)  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode or not lines:
            raise RuntimeError(f"scenario failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return ScenarioResult(**json.loads(lines[-1]))


class Running:
    """An instance started by :func:`start`: its result once its requests are done;
    it keeps serving (its arena held) until :meth:`stop`."""

    def __init__(self, proc: subprocess.Popen, release: str) -> None:
        assert proc.stdout is not None and proc.stderr is not None, "started with pipes"
        self.proc, self._release = proc, release
        self.stdout, self.stderr = proc.stdout, proc.stderr

    def result(self, timeout_s: float = 600) -> ScenarioResult:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.stdout.readline()
            if line.startswith("{"):
                return ScenarioResult(**json.loads(line))
            if not line and self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"instance ended without a result:\n{self.stderr.read()[-4000:]}")

    def stop(self, timeout_s: float = 120) -> int:
        """Let it exit (it checks every 0.1 s); killed if it does not within the bound."""
        open(self._release, "w").close()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.stdout.close()
            self.stderr.close()


def start(*, model_dir: str, arena_dir: str, release_dir: str, **options: Any) -> Running:
    """Start an instance with the connector in a fresh process (one-process vLLM)."""
    release = os.path.join(release_dir, f"release-{time.monotonic_ns()}")
    cmd, env = _command(connector=True, multiprocess=False, model_dir=model_dir,
                        arena_dir=arena_dir, hold_until=release, **options)  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    return Running(proc, release)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--connector", action="store_true")
    parser.add_argument("--multiprocess", action="store_true")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--arena-dir", default=None)
    parser.add_argument("--role", default="ec_both",
                        choices=["ec_both", "ec_producer", "ec_consumer"])  # fmt: skip
    parser.add_argument("--arena-name", default=None, help="share this arena with other runs")
    parser.add_argument("--persistent", action="store_true", help="keep the arena file")
    parser.add_argument("--order", default=None, help="image indices to request, e.g. 0,1,0")
    parser.add_argument(
        "--hold-until",
        default=None,
        help="after printing the result keep running until this file exists",
    )
    parser.add_argument("--nixl", default=None, help="the nixl config key, as JSON")
    parser.add_argument(
        "--transfer-params", default=None, help="JSON file: ec_transfer_params per request"
    )
    parser.add_argument("--json", action="store_true", help="run here, print one JSON line")
    args = parser.parse_args(argv)
    order = [int(i) for i in args.order.split(",")] if args.order else None
    nixl = json.loads(args.nixl) if args.nixl else None
    transfer_params = None
    if args.transfer_params:
        with open(args.transfer_params) as f:
            transfer_params = json.load(f)
    if args.json:
        tmp = tempfile.mkdtemp(prefix="ecoffload-scenario-")
        result, llm = run_here(
            connector=args.connector,
            multiprocess=args.multiprocess,
            model_dir=args.model_dir or build_tiny_paligemma(os.path.join(tmp, "model")),
            arena_dir=args.arena_dir or tmp,
            order=order,
            role=args.role,
            arena_name=args.arena_name,
            persistent=args.persistent,
            nixl=nixl,
            transfer_params=transfer_params,
        )
        print(json.dumps(asdict(result)), flush=True)
        deadline = time.monotonic() + 900
        while args.hold_until and not os.path.exists(args.hold_until):
            if time.monotonic() > deadline:
                return 1
            time.sleep(0.1)
        del llm
        return 0
    result = run(
        connector=args.connector,
        multiprocess=args.multiprocess,
        order=order,
        role=args.role,
        arena_name=args.arena_name,
        persistent=args.persistent,
        nixl=nixl,
        transfer_params=args.transfer_params,
    )
    print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
