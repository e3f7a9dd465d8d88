"""The harness the tests, the demo and the benchmarks share: a tiny random PaliGemma
built locally (``tiny_vlm.py``), ``vllm.LLM`` scenarios (``vllm_scenario.py``),
``ecoffload-vllm serve`` instances and their clients (``vllm_serve.py``), a NIXL
producer process (``remote_producer.py``) and the connector's real per-step path
(``real_path_steps.py``).

It ships in the package so that ``make demo`` and ``profiling/`` run from an install;
nothing in kernels/, engine/ or connector/ imports it.
"""
