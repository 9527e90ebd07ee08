"""KV tiers below the block pool: host memory and local disk keep the KV of evicted prefix blocks, keyed by
their prefix digest, and give it back on a later match instead of a recompute.

- `index.py`: one tier's books (pure Python): digest -> content, LRU, bounded; what the scheduler asks.
- `host.py`: the host-memory tier (pinned on CUDA).
- `disk.py`: the disk tier, one checked file per block, under a folder per model fingerprint.
- `worker.py`: `KVTiers`, what the engine core drives: offloads written behind the step and loads read ahead
  of it, by one worker thread.
"""
