"""The engine's step loop: EngineCore (engine_core.py) with its collaborators (steps.py: how a step runs and where its
tokens go; stats.py), the core as its clients hold it (client.py) and in an engine process of its own (process.py)."""
