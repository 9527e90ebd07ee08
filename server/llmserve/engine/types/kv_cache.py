"""What the layers share about the paged KV cache: how many blocks hold a number of tokens (`blocks_for`: the pool,
a request's check against the core's facts and the encoder's books all count so), and what the pool's prefix cache
gained and lost, as events (`KvEvent`: sched/kv_events.py's log records them, the front end takes them, a gateway
that routes on KV follows them)."""

from __future__ import annotations

from dataclasses import dataclass

# A stored block whose chain's salt the pool cannot tell (reloaded from a tier under a parent it no longer holds):
# given to no subscriber.
UNKNOWN_SALT = "\x00unknown"


@dataclass(slots=True, frozen=True)
class KvStored:
    number: int
    block_hash: bytes
    parent: bytes | None  # None: the first block of its chain, or a parent the pool no longer holds
    tokens: tuple[int, ...]
    salt: str | None


@dataclass(slots=True, frozen=True)
class KvRemoved:
    number: int
    block_hash: bytes
    salt: str | None


KvEvent = KvStored | KvRemoved


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks of `block_size` tokens hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)
