"""The adapter in the caches' keys: KV computed under one adapter is never served to another, or to the base model.

The KV of a token depends on the weights that computed it, so every cache of KV must be keyed by the adapter as
well as by the tokens (and the cache salt). All of them already derive from one place, the root of the prefix
hash chain (block_pool.prefix_root, per cache salt): a block's digest is chained from its parent's up to that root,
and a hit is checked against the block's recorded parent, so a different root is a different chain. The adapter
joins the root:

    root = adapter_root(prefix_root(salt), adapter.digest)     (no adapter: prefix_root(salt), as today)

- the prefix cache (BlockPool: lookup/register by digest, content checked with the parent) needs nothing more: a
  request under adapter X walks X's chain, and the base model's blocks (or Y's) are not on it;
- the KV tiers (engine/kv_tiers) keep blocks by those digests, so they inherit the separation; because the
  digest is of the adapter's files' bytes (adapters.LoraAdapter.digest) and not of a name or a load counter, a
  tier on disk that outlives the process still matches the same adapter read again, and never a changed one;
- sessions (SessionStore) hold blocks by session id and match by tokens alone: a session records the root it was
  computed under, and a request whose root differs (its adapter, or its salt, changed) matches nothing: it
  recomputes from the first token, and its blocks replace the session's when it finishes;
- append-mode conversations (llmserve.history) keep text, not KV: a turn under another adapter reads the same
  history and recomputes its KV through the session rule above; n > 1 completions share one request's adapter.

A root is a BLAKE2b-128 digest, like every block digest. The input is unambiguous: a tag that no salted or
unsalted root's input can begin with, then the fixed-width adapter digest and the fixed-width base root.
"""

from __future__ import annotations

import hashlib

from llmserve.engine.sched.block_pool import BlockHash

_TAG = b"llmserve.prefix.v1.lora\x00"  # prefix_root's inputs are b"llmserve.prefix.v1" and that + b"\x00salt\x00.."
ADAPTER_DIGEST_BYTES = 32


def adapter_root(base_root: BlockHash, adapter_digest: bytes | None) -> BlockHash:
    """The root of the prefix hash chain for a request under the adapter with `adapter_digest` (None: the base
    model, whose root is `base_root` unchanged), where `base_root` is block_pool.prefix_root(salt)."""
    if adapter_digest is None:
        return base_root
    if len(adapter_digest) != ADAPTER_DIGEST_BYTES:
        raise ValueError(f"an adapter digest has {ADAPTER_DIGEST_BYTES} bytes, not {len(adapter_digest)}")
    return hashlib.blake2b(_TAG + adapter_digest + base_root, digest_size=len(base_root)).digest()
