"""The engine's front end, torch-free: the asyncio engine the gRPC edge serves from (async_engine.py), and what turns
the core's token outputs into a caller's deltas (output_processor.py, detokenizer.py; fanout.py for n > 1)."""
