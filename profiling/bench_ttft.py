"""Time to first token for a repeated image through ``vllm serve``, with and without ecoffload.

Two servers run side by side, started as :class:`.vllm_serve.Server` starts
them (the installed ``ecoffload-vllm serve``, same flags; one with the
connector on an arena in /dev/shm), on a random PaliGemma of the chosen
geometry (default: a SigLIP-base-sized tower, 196 tokens per image, and a
small Gemma). vLLM's encoder cache holds two images; the bench cycles through
more, so every repeat has left it: without the connector the encoder runs
again, with ecoffload the item comes back from the arena.

The KV prefix cache is off on both servers (``--no-enable-prefix-caching``, as
:func:`.vllm_serve.server_command` always passes): with it, a repeated prompt
and image reuses the KV blocks of its first request and skips the encoder
altogether, which measures neither path.

Each request streams (``return_token_ids``); its time to first token runs from
sending it to the first chunk that carries a generated token id (not text: a
first token can decode to nothing). Requests alternate between the servers,
which goes first alternating too. Beside it, once the servers are gone, one
image's two component times: vLLM's own vision tower + projector
(``embed_multimodal`` in a fresh ``vllm.LLM`` with the servers' settings) and
an ``OffloadCache.load`` of one item of that shape from a shared arena like the
connector's. Checks: the connector served every repeat
(``vllm:ecoffload_items_loaded_total``), the generated tokens equal the
no-connector server's, and each prompt holds one image's placeholder tokens.

``--cluster`` adds the cluster tier: a ``mooncake_master`` on 127.0.0.1, the
ecoffload server publishes every item it saves, and a third server, on its own
arena with the tier on, is asked each image once, after the first round of
first sights (so every one is a cluster hit: fetched from the store into its
arena, then loaded). Its times to first token sit beside the first repeat
round's two others (same images, same round, the order rotating over the three
servers), a third column; checks: every one of its requests was a cluster
fetch, its encoder never ran for them (no save) and its tokens equal the
no-connector server's.

    python -m ecoffload.profiling.bench_ttft [--vision siglip-base] [--images 4]
        [--rounds 3] [--max-tokens 4] [--cluster] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from ..engine.base.sizes import format_bytes
from ..testing.tiny_vlm import PRESETS, build_tiny_paligemma, geometry, image_token_id
from ..testing.vllm_scenario import ec_transfer_config, make_images
from ..testing.vllm_serve import (
    SERVED_NAME,
    Server,
    ServerError,
    arena_leftovers,
    chat_messages,
    server_env,
)

#: vLLM's encoder cache keeps this many images (``--max-num-batched-tokens`` sizes it).
ENCODER_CACHE_IMAGES = 2
LOADED_METRIC = "vllm:ecoffload_items_loaded_total"
SAVED_METRIC = "vllm:ecoffload_items_saved_total"
FETCHED_METRIC = "vllm:ecoffload_cluster_items_fetched_total"
PUBLISHED_METRIC = "vllm:ecoffload_cluster_publishes_total"
# Pause before each measured request: a server that has just answered keeps its
# threads busy for a moment, which on a small CPU slows whatever runs next.
SETTLE_S = 1.0


class TtftError(RuntimeError):
    """A stream or a server did not do what the measurement needs."""


@dataclass
class FirstToken:
    """One streamed request: when its first token came, and what it generated."""

    seconds: float  # send -> first chunk carrying a generated token id
    total_seconds: float  # send -> end of the stream
    token_ids: list[int]
    prompt_token_ids: list[int]
    arrivals: list[float] = field(default_factory=list)  # send -> each chunk with token ids


def stream_first_token(
    client: Any, image: Any, *, max_tokens: int = 4, prompt: str = "describe"
) -> FirstToken:
    """Send one greedy streaming chat request and time its first generated token."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=chat_messages(image, prompt),
        temperature=0.0,
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    first: float | None = None
    token_ids: list[int] = []
    prompt_token_ids: list[int] = []
    arrivals: list[float] = []
    for chunk in stream:
        prompt_token_ids = (chunk.model_extra or {}).get("prompt_token_ids") or prompt_token_ids
        for choice in chunk.choices:
            ids = (choice.model_extra or {}).get("token_ids") or []
            if ids:
                arrivals.append(time.perf_counter() - t0)
                if first is None:
                    first = arrivals[-1]
            token_ids += ids
    total = time.perf_counter() - t0
    if first is None:
        raise TtftError(
            "expected a streamed chunk carrying generated token ids (return_token_ids), "
            "found none: does this vLLM stream token_ids?"
        )
    return FirstToken(first, total, token_ids, prompt_token_ids, arrivals)


@dataclass
class TtftResult:
    """What :func:`run` measured; seconds everywhere."""

    vision: str
    geometry: dict[str, int | float]
    images: int
    rounds: int
    max_tokens: int
    item_shape: list[int]
    item_bytes: int
    # Repeated images, request by request (same order on both sides).
    plain_repeat: list[float] = field(default_factory=list)  # encoder runs
    offload_repeat: list[float] = field(default_factory=list)  # arena load
    # First sight of each image: the encoder runs on both (and ecoffload saves).
    plain_first: list[float] = field(default_factory=list)
    offload_first: list[float] = field(default_factory=list)
    encoder_seconds: list[float] = field(default_factory=list)  # vLLM's forward, per run
    embedding_shape: list[int] = field(default_factory=list)  # what that forward returned
    arena_load_seconds: list[float] = field(default_factory=list)  # OffloadCache.load, per run
    items_loaded: float = 0.0  # by the connector during the repeats (/metrics)
    items_saved: float = 0.0
    tokens_identical: bool = False
    placeholder_tokens: list[int] = field(default_factory=list)  # per request, both servers
    load_average: list[float] = field(default_factory=list)  # 1-minute, before and after
    arena_leftovers: list[str] = field(default_factory=list)
    # --cluster: each image once on the third server (a cluster hit), and the same
    # images' requests of that round on the other two (the first repeat round).
    cluster: bool = False
    cluster_hit: list[float] = field(default_factory=list)
    cluster_plain: list[float] = field(default_factory=list)  # encoder runs
    cluster_local: list[float] = field(default_factory=list)  # arena load
    cluster_fetched: float = 0.0  # by the third server during those requests (/metrics)
    cluster_saved: float = 0.0  # its encoder's outputs meanwhile (must stay 0)
    cluster_tokens_identical: bool = False

    def ratios(self) -> list[float]:
        """Per repeated image: TTFT without the connector / with ecoffload."""
        return [p / o for p, o in zip(self.plain_repeat, self.offload_repeat, strict=True)]

    def cluster_ratios(self) -> tuple[list[float], list[float]]:
        """Per image of the cluster round: (cluster hit / local hit, re-encode / cluster hit)."""
        hit, local, plain = self.cluster_hit, self.cluster_local, self.cluster_plain
        return (
            [c / o for c, o in zip(hit, local, strict=True)],
            [p / c for p, c in zip(plain, hit, strict=True)],
        )


def run(
    vision: str = "siglip-base",
    *,
    images: int = 4,
    rounds: int = 3,
    max_tokens: int = 4,
    seed: int = 0,
    component_runs: int = 5,
    log_dir: str | None = None,
    cluster: bool = False,
) -> TtftResult:
    """Start the servers (and with ``cluster`` a master), measure, stop them (SIGINT,
    then the group is killed)."""
    g = geometry(vision)
    if images <= ENCODER_CACHE_IMAGES:
        raise ValueError(
            f"expected more images than vLLM's encoder cache holds ({ENCODER_CACHE_IMAGES}), "
            f"got {images}: with fewer a repeat is served by vLLM itself, by neither path"
        )
    if rounds < 1:
        raise ValueError(f"expected at least 1 round of repeats, got {rounds}")
    # One more image, never measured: each server's first request warms it up.
    *pictures, warm_up = make_images(images + 1, size=g.image_size)
    shape = [g.num_image_tokens, g.text_hidden]
    result = TtftResult(
        vision, asdict(g) | {"num_image_tokens": g.num_image_tokens}, images, rounds,
        max_tokens, shape, 2 * shape[0] * shape[1],  # bfloat16, as the servers run
    )  # fmt: skip
    result.cluster = cluster
    result.load_average.append(os.getloadavg()[0])
    budget = ENCODER_CACHE_IMAGES * g.num_image_tokens
    with contextlib.ExitStack() as stack:
        model_dir = build_tiny_paligemma(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="ecoffload-ttft-model-")),
            seed=seed,
            vision=vision,
        )
        # tmpfs, like the default arena; removing the folder removes anything left
        arena_dir = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="ecoffload-ttft-", dir=_shm_or_tmp())
        )
        logs = log_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="ecoffload-ttft-"))
        tier = stack.enter_context(_cluster_tier(logs)) if cluster else None
        _serve_and_measure(result, model_dir, arena_dir, logs, pictures, warm_up, budget, tier)
        # Servers gone now: the component times do not share the CPU with them.
        encoder = time_encoder(model_dir, runs=component_runs)
        result.encoder_seconds, result.embedding_shape = encoder["seconds"], encoder["shape"]
        result.arena_load_seconds = time_arena_load(shape, arena_dir, runs=4 * component_runs)
    result.load_average.append(os.getloadavg()[0])
    return result


@contextlib.contextmanager
def _cluster_tier(logs: str) -> Any:
    """A ``mooncake_master`` on 127.0.0.1 for the run; yields the servers' ``cluster`` config."""
    from ..engine.cluster.master import MasterProcess
    from ..engine.cluster.value import random_key_file

    master = MasterProcess(log_path=os.path.join(logs, "mooncake-master.log")).start()
    try:
        yield {
            "master": master.address, "metadata": master.metadata, "host": "127.0.0.1",
            "segment_bytes": "64MiB", "fetch_timeout_s": 10,
            "key_file": random_key_file(os.path.join(logs, "cluster.key")),
        }  # fmt: skip
    finally:
        master.kill()


def rotation(sides: tuple[str, ...], turn: int) -> tuple[str, ...]:
    """``sides`` rotated by ``turn``: who goes first changes from one request to the next."""
    k = turn % len(sides)
    return sides[k:] + sides[:k]


def _serve_and_measure(
    result: TtftResult,
    model_dir: str,
    arena_dir: str,
    logs: str,
    pictures: list,
    warm_up: Any,
    budget: int,
    tier: dict[str, Any] | None = None,
) -> None:
    """The servers: first sights, then ``result.rounds`` rounds of repeats, the order
    rotating; with ``tier``, the cluster server joins the first repeat round."""
    arena_name = f"ecoffload-ttft-{uuid.uuid4().hex[:12]}"
    names = [arena_name] + ([f"{arena_name}-cluster"] if tier else [])
    with contextlib.ExitStack() as stack:
        plain = stack.enter_context(Server.start(
            model_dir, connector=False, max_num_batched_tokens=budget,
            log_path=os.path.join(logs, "without-connector.log"),
        ))  # fmt: skip
        offload = stack.enter_context(Server.start(
            model_dir, connector=True, arena_dir=arena_dir, arena_name=names[0], cluster=tier,
            max_num_batched_tokens=budget, log_path=os.path.join(logs, "with-ecoffload.log"),
        ))  # fmt: skip
        servers = {"plain": plain, "offload": offload}
        if tier:
            servers["cluster"] = stack.enter_context(Server.start(
                model_dir, connector=True, arena_dir=arena_dir, arena_name=names[1],
                cluster=tier, max_num_batched_tokens=budget,
                log_path=os.path.join(logs, "cluster-hits.log"),
            ))  # fmt: skip
        clients = {side: server.client(timeout_s=300.0) for side, server in servers.items()}
        tokens: dict[str, list[list[int]]] = {side: [] for side in servers}
        placeholder = image_token_id()

        def each(index: int, turn: int, sides: tuple[str, ...]) -> dict[str, FirstToken]:
            got = {}
            for side in rotation(sides, turn):
                time.sleep(SETTLE_S)
                got[side] = stream_first_token(
                    clients[side], pictures[index], max_tokens=result.max_tokens
                )
                tokens[side].append(got[side].token_ids)
                result.placeholder_tokens.append(got[side].prompt_token_ids.count(placeholder))
            return got

        for side in ("plain", "offload"):
            stream_first_token(clients[side], warm_up, max_tokens=result.max_tokens)
        images = len(pictures)
        for index in range(images):
            got = each(index, index, ("plain", "offload"))
            result.plain_first.append(got["plain"].seconds)
            result.offload_first.append(got["offload"].seconds)
        saved = offload.wait_for_metric(SAVED_METRIC, images + 1)  # + the warm-up image
        loaded_before = saved.get(LOADED_METRIC, 0.0)
        cluster_before: dict[str, float] = {}
        if tier:
            # the cluster server warms up on the warm-up image (a cluster hit once it is
            # published); every measured image is published before it is asked
            offload.wait_for_metric(PUBLISHED_METRIC, images + 1, timeout_s=60)
            stream_first_token(clients["cluster"], warm_up, max_tokens=result.max_tokens)
            cluster_before = servers["cluster"].wait_for_metric(FETCHED_METRIC, 1, timeout_s=10)
        for r in range(result.rounds):
            for index in range(images):
                sides = ("plain", "offload", "cluster") if tier and r == 0 else ("plain", "offload")
                got = each(index, images + r * images + index, sides)
                result.plain_repeat.append(got["plain"].seconds)
                result.offload_repeat.append(got["offload"].seconds)
                if "cluster" in got:
                    result.cluster_hit.append(got["cluster"].seconds)
                    result.cluster_plain.append(got["plain"].seconds)
                    result.cluster_local.append(got["offload"].seconds)
        result.items_saved = saved.get(SAVED_METRIC, 0.0)
        repeats = len(result.offload_repeat)
        metrics = offload.wait_for_metric(LOADED_METRIC, loaded_before + repeats)
        result.items_loaded = metrics.get(LOADED_METRIC, 0.0) - loaded_before
        result.tokens_identical = tokens["plain"] == tokens["offload"]
        if tier:
            fetched = cluster_before.get(FETCHED_METRIC, 0.0)
            after = servers["cluster"].wait_for_metric(FETCHED_METRIC, fetched + images)
            result.cluster_fetched = after.get(FETCHED_METRIC, 0.0) - fetched
            result.cluster_saved = after.get(SAVED_METRIC, 0.0) - cluster_before.get(
                SAVED_METRIC, 0.0
            )
            result.cluster_tokens_identical = tokens["cluster"] == tokens["plain"][:images]
        for server in reversed(list(servers.values())):
            with contextlib.suppress(ServerError):
                server.interrupt()  # SIGINT: the connector unlinks its arena on the way out
    result.arena_leftovers = [p for n in names for p in arena_leftovers(arena_dir, n)]


def _shm_or_tmp() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def embed_seconds(worker: Any, runs: int) -> dict[str, Any]:
    """collective_rpc target: seconds per ``embed_multimodal`` of one image on this worker.

    vLLM's own vision tower + projector (its kernels, the served dtype) on a random
    pixel tensor of the tower's size; one warm-up call. Also the embedding's shape:
    the item ecoffload would store.
    """
    import torch

    model = worker.get_model()
    size = model.config.vision_config.image_size
    dtype = next(model.parameters()).dtype
    pixels = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0))
    seconds, shape = [], []
    with torch.inference_mode():
        for _ in range(runs + 1):
            t0 = time.perf_counter()
            (embedding,) = model.embed_multimodal(pixel_values=pixels.to(dtype))
            seconds.append(time.perf_counter() - t0)
            shape = list(embedding.shape)
    return {"seconds": seconds[1:], "shape": shape, "dtype": str(dtype)}


def _embed_seconds_here(model_dir: str, runs: int) -> dict[str, Any]:
    """In this process: a ``vllm.LLM`` with the servers' settings, then :func:`embed_seconds`."""
    with open(os.path.join(model_dir, "config.json")) as f:
        vision = json.load(f)["vision_config"]
    budget = ENCODER_CACHE_IMAGES * (vision["image_size"] // vision["patch_size"]) ** 2
    from ..connector import cpu_build

    cpu_build.install()  # multimodal models without torchvision
    from vllm import LLM

    llm = LLM(
        model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=1024,
        max_num_seqs=2, max_num_batched_tokens=budget, limit_mm_per_prompt={"image": 1},
        enable_prefix_caching=False, seed=0,
    )  # fmt: skip
    return llm.collective_rpc(embed_seconds, args=(runs,))[0]


def time_encoder(model_dir: str, *, runs: int = 5, timeout_s: float = 600.0) -> dict[str, Any]:
    """vLLM's encoder time for one image (:func:`embed_seconds`), in a fresh process.

    Fresh, bounded and killed with its group on timeout: vLLM holds process-global
    state, and the bench's own process stays free of it.
    """
    env = server_env() | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the worker is in that process
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc of a function
    }
    cmd = [sys.executable, "-m", "ecoffload.profiling.bench_ttft", "--embed-seconds",
           model_dir, "--embed-runs", str(runs)]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=tempfile.gettempdir(), start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise TtftError(
            f"expected vLLM's encoder timing within {timeout_s:.0f} s; killed it"
        ) from None
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise TtftError(f"vLLM's encoder timing failed (exit {proc.returncode}):\n{err[-4000:]}")
    return json.loads(lines[-1])


def time_arena_load(shape: list[int], directory: str, *, runs: int = 20) -> list[float]:
    """Seconds per ``OffloadCache.load`` of one bfloat16 item of ``shape``.

    From a shared arena configured as the connector's (:func:`.ec_transfer_config`),
    to host memory (no GPU here), on one torch thread (as ``bench_host`` times its
    copies: on a busy small host a pool's spin-waits make a copy of a few hundred KB
    10-30x slower); one warm-up load; every load checked bit-exact.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _time_arena_load(shape, directory, runs)
    finally:
        torch.set_num_threads(threads)


def _time_arena_load(shape: list[int], directory: str, runs: int) -> list[float]:
    import torch

    from ..engine.cache import OffloadCache

    extra = ec_transfer_config(directory)["ec_connector_extra_config"]
    item = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    name = f"ecoffload-ttft-load-{uuid.uuid4().hex[:12]}"
    seconds = []
    with OffloadCache.create(
        name, arena_bytes=extra["arena_bytes"], block_bytes=extra["block_bytes"],
        directory=directory, device="cpu", shared=True,
    ) as cache:  # fmt: skip
        cache.save({"image": item})
        cache.flush()
        for _ in range(runs + 1):
            t0 = time.perf_counter()
            loaded = cache.load(["image"])
            cache.flush()
            seconds.append(time.perf_counter() - t0)
            if "image" not in loaded or not torch.equal(loaded["image"], item):
                raise TtftError("expected the arena to return the saved item bit-exact; it did not")
    return seconds[1:]


def _ms(values: list[float]) -> str:
    """Median [min - max] in milliseconds."""
    if not values:
        return "-"
    return (
        f"{statistics.median(values) * 1e3:.1f} ms "
        f"[{min(values) * 1e3:.1f} - {max(values) * 1e3:.1f}]"
    )


def _x(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f}x [{min(values):.2f} - {max(values):.2f}]"


def table(result: TtftResult) -> str:
    """The Markdown table ``main`` prints."""
    g = result.geometry
    repeats = len(result.plain_repeat)
    encoder, load = result.encoder_seconds, result.arena_load_seconds
    component_ratio = statistics.median(encoder) / statistics.median(load) if load else 0.0
    rows = [
        ("time to first token, repeated image", _ms(result.plain_repeat),
         _ms(result.offload_repeat), _x(result.ratios())),
        ("time to first token, first sight (encoder on both)", _ms(result.plain_first),
         _ms(result.offload_first), _x([p / o for p, o in zip(
             result.plain_first, result.offload_first, strict=True)])),
        ("one image: vision tower + projector (vLLM's embed_multimodal, bf16)", _ms(encoder),
         "-", ""),
        (f"one image: arena load of {result.item_shape[0]} x {result.item_shape[1]} bf16 "
         f"({format_bytes(result.item_bytes)}, OffloadCache.load)", "-", _ms(load),
         f"{component_ratio:.0f}x (medians)" if load else "-"),
        ("repeats served from the arena (/metrics)", "-",
         f"{result.items_loaded:g} of {repeats}", ""),
        ("generated tokens identical", "-", "yes" if result.tokens_identical else "NO", ""),
        ("image placeholder tokens per prompt", "-",
         ", ".join(str(n) for n in sorted(set(result.placeholder_tokens))), ""),
    ]  # fmt: skip
    head = (
        f"vllm serve on {result.vision}: SigLIP tower {g['image_size']} px / patch "
        f"{g['patch_size']} -> {g['num_image_tokens']} tokens, hidden {g['vision_hidden']}, "
        f"{g['vision_layers']} layers; Gemma hidden {g['text_hidden']}, {g['text_layers']} "
        f"layers. {result.images} images cycled, encoder cache of {ENCODER_CACHE_IMAGES}, "
        f"{result.rounds} rounds of repeats, {result.max_tokens} greedy tokens; medians "
        f"[min - max]; load average {result.load_average[0]:.2f} -> "
        f"{result.load_average[-1]:.2f}\n"
    )
    lines = [head, "| | without connector | with ecoffload | ratio |", "|---|---|---|---|"]
    lines += [f"| {name} | {left} | {right} | {ratio} |" for name, left, right, ratio in rows]
    if result.cluster:
        lines += ["", cluster_table(result)]
    if result.arena_leftovers:
        lines.append(f"\narena files left behind: {result.arena_leftovers}")
    return "\n".join(lines)


def cluster_table(result: TtftResult) -> str:
    """The ``--cluster`` round: each image once per server, the order rotating."""
    to_local, speedup = result.cluster_ratios()
    return "\n".join([
        f"cluster round: {len(result.cluster_hit)} images, each asked once of each server "
        f"(the first repeat round; the cluster server had never seen them: "
        f"{result.cluster_fetched:g} fetched from the store, {result.cluster_saved:g} encoded; "
        f"tokens identical to the no-connector server's: "
        f"{'yes' if result.cluster_tokens_identical else 'NO'})",
        "| time to first token | re-encoded (no connector) | local arena hit | cluster tier hit "
        "| cluster / local | re-encoded / cluster |",
        "|---|---|---|---|---|---|",
        f"| repeated image | {_ms(result.cluster_plain)} | {_ms(result.cluster_local)} | "
        f"{_ms(result.cluster_hit)} | {_x(to_local)} | {_x(speedup)} |",
    ])  # fmt: skip


def passed(result: TtftResult) -> bool:
    """Whether the run measured what it claims: every repeat from the arena, same tokens,
    one image's placeholders in every prompt, vLLM's encoder output the shape of the
    item timed, nothing left in the arena folder; with ``cluster``, :func:`cluster_measured`."""
    return (
        result.items_loaded == len(result.offload_repeat)
        and result.tokens_identical
        and set(result.placeholder_tokens) == {result.geometry["num_image_tokens"]}
        and result.embedding_shape == result.item_shape
        and not result.arena_leftovers
        and (not result.cluster or cluster_measured(result))
    )


def cluster_measured(result: TtftResult) -> bool:
    """Whether the cluster round measured cluster hits: every image of it fetched from
    the store by the cluster server, none encoded there, the same tokens."""
    return (
        len(result.cluster_hit) == result.images
        and result.cluster_fetched == result.images
        and result.cluster_saved == 0
        and result.cluster_tokens_identical
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--vision", choices=sorted(PRESETS), default="siglip-base")
    parser.add_argument(
        "--images",
        type=int,
        default=4,
        help=f"distinct images cycled (more than {ENCODER_CACHE_IMAGES})",
    )
    parser.add_argument("--rounds", type=int, default=3, help="times each image repeats")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--log-dir", help="keep the servers' logs here")
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="add a mooncake_master and a third server whose repeats are cluster hits",
    )
    parser.add_argument("--json", action="store_true", help="print the raw result as JSON")
    parser.add_argument(
        "--embed-seconds",
        metavar="MODEL_DIR",
        help="only: time vLLM's encoder on a built checkpoint, print JSON",
    )
    parser.add_argument("--embed-runs", type=int, default=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)  # fmt: skip
    if args.embed_seconds:
        timing = _embed_seconds_here(args.embed_seconds, args.embed_runs)
        print(json.dumps(timing), flush=True)
        return 0
    print(f"Starting {3 if args.cluster else 2} vllm serve instances on the {args.vision} "
          "PaliGemma (a minute or two each on a small CPU)...", flush=True)  # fmt: skip
    result = run(
        args.vision, images=args.images, rounds=args.rounds, max_tokens=args.max_tokens,
        log_dir=args.log_dir, cluster=args.cluster,
    )  # fmt: skip
    print(json.dumps(asdict(result), indent=2) if args.json else "\n" + table(result))
    return 0 if passed(result) else 1


if __name__ == "__main__":
    raise SystemExit(main())
