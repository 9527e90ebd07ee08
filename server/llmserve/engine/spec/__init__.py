"""Speculative decoding without a draft model, reached through one object the core holds (speculation.py), None when
--speculative is off."""
