"""LoRA adapters over the served model's weights (issue 32): many fine-tunes of one base model in one batch.

- `adapters.py`: reading a PEFT adapter folder, checked against the served model's shape (`LoadedModel.shape`),
  the target modules and --max-lora-rank; PEFT's scaling.
- `registry.py`: the books of the adapters the server knows by name, at most --max-cpu-loras in host memory
  (least recently used unloaded first, never one a request holds).
- `slot_books.py`: the books of the --max-loras device slots a step's adapters are copied into.
- `weights.py`: the stacked factors of every slot, per layer and per linear (the tensors).
- `ops.py`: one step's deltas, batched per linear: decode rows grouped by adapter, prompt chunks as segments.
- `hooks.py`: the deltas on a transformers model's own projections, by forward hooks.
- `cache_keys.py`: the adapter in the prefix hash chain's root, so that no cache serves one adapter's KV to another.
"""
