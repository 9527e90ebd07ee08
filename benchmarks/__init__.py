"""The benchmarks of llmserve: benchmarks/run.py is the entry, benchmarks/README.md the lab notes."""
