"""The engine, one folder per layer: frontend/, core/, sched/, sample/, spec/, lora/, kv_tiers/, backends/, and
types/ below them all (docs/architecture.md; which may import which: docs/layers.md); config.py holds the settings
every layer reads."""
