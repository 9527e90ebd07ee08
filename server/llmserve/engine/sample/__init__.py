"""Sampling: the batched sampler, the constraints' token masks, each sampled sequence's seeded random stream, and the
constraints themselves (llguidance: the front end's check, the core's compiler, a request's grammar state)."""
