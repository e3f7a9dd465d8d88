"""The main demo: vLLM serving images with and without ecoffload, side by side.

    python -m ecoffload.profiling.demo [--multiprocess]
    python -m ecoffload.profiling.demo --ttft [--vision siglip-base]

Runs the scenario of :mod:`..testing.vllm_scenario` twice on the embedded default (a
tiny random PaliGemma built locally; CPU vLLM here, CUDA vLLM on a GPU host):
six distinct images while vLLM's own encoder cache keeps two, then the first
two again. Prints what each run did: encoder runs, items served from the
arena, bytes moved, hit rate, time per request, start-up, and whether the
generated tokens are identical. Both runs come after a warm-up run of one
request on the same model (the host's cold start: files read from disk,
vLLM's caches; it is shown apart), so the two columns compare like with like.
Without vLLM installed it falls back to the engine-only demo
(:mod:`.engine_demo`).

``--ttft``: the figure users feel instead (:mod:`.bench_ttft`): time to first
token for a repeated image through two ``vllm serve`` instances, without and
with ecoffload, on a SigLIP-base-sized tower (196 tokens per image), beside
the encoder's time and the arena load's for one image (several minutes on a
small CPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
from typing import Any

from ..engine.base.sizes import format_bytes
from ..testing import vllm_scenario
from ..testing.tiny_vlm import PRESETS, build_tiny_paligemma
from . import bench_ttft, engine_demo


def measure(
    multiprocess: bool = False,
) -> tuple[vllm_scenario.ScenarioResult, vllm_scenario.ScenarioResult, float]:
    """(without, with the connector, the warm-up's start-up seconds): a warm-up run
    of one request first pays the cold start, then both measured runs start warm,
    on one model built once."""
    with tempfile.TemporaryDirectory(prefix="ecoffload-demo-") as tmp:
        model_dir = build_tiny_paligemma(os.path.join(tmp, "model"))
        kw: dict[str, Any] = {"multiprocess": multiprocess, "model_dir": model_dir}
        cold = vllm_scenario.run(connector=False, order=[0], **kw)
        plain = vllm_scenario.run(connector=False, **kw)
        offload = vllm_scenario.run(connector=True, **kw)
    return plain, offload, cold.load_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--multiprocess", action="store_true",
                        help="vLLM's default multi-process mode (slower start-up)")  # fmt: skip
    parser.add_argument("--ttft", action="store_true",
                        help="time to first token of a repeated image, via vllm serve")  # fmt: skip
    parser.add_argument("--vision", choices=sorted(PRESETS), default="siglip-base",
                        help="the model's geometry for --ttft")  # fmt: skip
    args = parser.parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed: running the engine-only demo instead.\n")
        return engine_demo.main([])
    if args.ttft:
        return bench_ttft.main(["--vision", args.vision])

    print("Running vLLM on a tiny local PaliGemma: a warm-up, then without and with "
          "ecoffload (a minute or two)...", flush=True)  # fmt: skip
    plain, offload, cold = measure(args.multiprocess)
    stats = offload.connector_stats
    repeats = len(plain.requests) - len(set(plain.requests))
    rows = [
        ("requests (distinct images + repeats)",
         f"{len(plain.requests)} ({len(set(plain.requests))} + {repeats})", None),
        ("encoder runs", sum(plain.encoder_runs), sum(offload.encoder_runs)),
        ("items saved to the arena", "-", stats.get("items_saved", 0)),
        ("items served from the arena", "-", stats.get("items_loaded", 0)),
        ("bytes saved / loaded", "-",
         f"{format_bytes(stats.get('bytes_saved', 0))} / "
         f"{format_bytes(stats.get('bytes_loaded', 0))}"),
        ("arena hit rate on repeats", "-",
         f"{stats.get('items_loaded', 0) / repeats:.0%}" if repeats else "-"),
        ("median time per request", _ms(plain.seconds), _ms(offload.seconds)),
        ("median time per repeated request", _ms(plain.seconds[-repeats:]),
         _ms(offload.seconds[-repeats:])),
        ("LLM start-up (both after the warm-up)", f"{plain.load_seconds:.1f} s",
         f"{offload.load_seconds:.1f} s"),
        ("cold start-up (the warm-up run, not compared)", f"{cold:.1f} s", None),
        ("generated tokens identical", "-",
         "yes" if offload.token_ids == plain.token_ids else "NO"),
    ]  # fmt: skip
    mode = "multi-process" if args.multiprocess else "one process"
    print(f"\nvLLM ({mode}), encoder cache of 2 images, greedy decoding of 8 tokens\n")
    print("| | without connector | with ecoffload |\n|---|---|---|")
    for name, left, right in rows:
        print(f"| {name} | {left} | {'' if right is None else right} |")
    return 0 if offload.token_ids == plain.token_ids else 1


def _ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:.1f} ms" if seconds else "-"


if __name__ == "__main__":
    raise SystemExit(main())
