"""The adapter in the prefix hash chain's root: another adapter, or the base model, is another chain; the base
model's root is the one it has always had (so that KV tiers kept on disk still match it)."""

from __future__ import annotations

import pytest

from llmserve.engine.lora.cache_keys import adapter_root
from llmserve.engine.sched.block_pool import BlockPool, chain_hash, prefix_root

X, Y = bytes(range(32)), bytes(range(1, 33))


def test_the_base_model_keeps_its_root() -> None:
    for salt in (None, "alice"):
        assert adapter_root(prefix_root(salt), None) == prefix_root(salt)


def test_every_adapter_and_salt_has_a_root_of_its_own() -> None:
    roots = {
        (salt, adapter): adapter_root(prefix_root(salt), adapter)
        for salt in (None, "alice", "bob")
        for adapter in (None, X, Y)
    }
    assert len(set(roots.values())) == len(roots)
    assert all(len(root) == 16 for root in roots.values())
    assert adapter_root(prefix_root("alice"), X) == adapter_root(prefix_root("alice"), X)  # stable


def test_a_salt_cannot_be_crafted_into_an_adapters_root() -> None:
    # The adapter root's input starts with a tag that no salted root's input can: a salt that spells it out is
    # still only a salt.
    crafted = ".lora\x00" + X.decode("latin-1")
    assert prefix_root(crafted) != adapter_root(prefix_root(None), X)
    assert prefix_root(crafted) not in {adapter_root(prefix_root(s), X) for s in (None, "", crafted)}


def test_the_pool_serves_a_prefix_only_on_its_own_chain() -> None:
    pool = BlockPool(4, 2)
    tokens = [5, 6]
    base_root, lora_root = prefix_root(None), adapter_root(prefix_root(None), X)
    (block,) = pool.allocate(1)
    lora_hash = chain_hash(lora_root, tokens)
    pool.register(block, lora_hash, lora_root, tokens)
    assert pool.lookup(lora_hash, lora_root, tokens) == block
    assert pool.lookup(chain_hash(base_root, tokens), base_root, tokens) is None  # the base model: a miss
    other = adapter_root(base_root, Y)
    assert pool.lookup(chain_hash(other, tokens), other, tokens) is None  # another adapter: a miss


def test_a_digest_of_another_width_is_refused() -> None:
    with pytest.raises(ValueError, match="32 bytes, not 16"):
        adapter_root(prefix_root(None), bytes(16))
