"""The engine, one folder per layer: frontend/, core/, sched/, sample/, spec/, lora/, kv_tiers/, backends/
(docs/architecture.md); config.py holds the settings every layer reads."""
