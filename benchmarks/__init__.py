"""The benchmark ladder for llmserve: see benchmarks/run.py."""
