"""The engine, one folder per layer: frontend/, core/, sched/, sample/, spec/, lora/, kv_tiers/, backends/ (README,
Architecture); config.py holds the settings every layer reads."""
