"""NVTX ranges, benchmarks, plots and the demo."""
