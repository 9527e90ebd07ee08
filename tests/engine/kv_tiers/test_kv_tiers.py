"""KV tiers with a real model: evicted KV goes to host memory or disk and comes back, token for token.

Each engine here has a pool of a few blocks, so a conversation's KV is evicted between its turns by other
conversations. A returning turn must give the same greedy tokens whether its KV was reloaded from a tier,
recomputed, or never evicted at all (transformers' generate on the whole prompt), in float64 on the tiny model
and float32 on the default one; the disk tier survives an engine restart; a corrupt, truncated, deleted or
foreign block file, a full tier and a failed write all fall back to recompute.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.core.engine_core import EngineCore
from llmserve.engine.kv_tiers.disk import DiskTier, DiskTierError
from llmserve.engine.sched.block_pool import BlockContent, chain_hash, prefix_root
from llmserve.engine.types.model import LoadedModel
from llmserve.engine.types.request import GenerationRequest, StoppingParams
from llmserve.models.loader import from_config
from tests.testing import TINY_VOCAB, greedy_reference, tiny_config

BS = 16


def reference(loaded: LoadedModel, prompt: list[int], max_new: int) -> list[int]:
    """transformers' greedy tokens for the whole prompt run alone (no cache, nothing evicted)."""
    impl = loaded.model.config._attn_implementation
    loaded.model.set_attn_implementation("sdpa")
    try:
        return greedy_reference(loaded.model, prompt, max_new)
    finally:
        loaded.model.set_attn_implementation(impl)


def tiny64() -> LoadedModel:
    return from_config(tiny_config(max_positions=1024), dtype=torch.float64)


def core_for(loaded: LoadedModel, **overrides: object) -> EngineCore:
    settings: dict[str, object] = dict(
        block_size=BS, kv_cache_tokens=20 * BS, max_num_seqs=2, max_num_batched_tokens=128, session_pool_fraction=0.5
    )
    settings.update(overrides)
    return EngineCore(loaded, EngineConfig(**settings))  # type: ignore[arg-type]


def run(core: EngineCore, prompt: list[int], max_new: int, session: str | None = None, salt: str | None = None):
    """One call, stepped on this thread until it ends: (tokens, prompt tokens served from cached KV)."""
    outputs: list = []
    request = GenerationRequest(
        f"r{random.random()}",
        tuple(prompt),
        stopping=StoppingParams(max_new_tokens=max_new, ignore_eos=True),
        session_id=session,
        cache_salt=salt,
    )
    handle = core.submit(request)
    for _ in range(100_000):
        core.drain_inbox()
        outputs += [o for o in core.take_outputs() if o.handle == handle]
        if outputs and outputs[-1].finished:
            assert outputs[-1].error is None
            return [t for o in outputs for t in o.token_ids], outputs[-1].usage.cached_prompt_tokens
        core.step()
    raise AssertionError("no final delta")


def prompts(seed: int, n: int, length: int, vocab: int = TINY_VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def conversation(core: EngineCore, sessions: bool, seed: int = 0) -> tuple[list[int], int, list[int]]:
    """Turn 1 of A, then B and C (which push A's KV out of the pool), then A's turn 2 on A's whole history.
    Returns (A's turn-2 tokens, its cached prompt tokens, its turn-2 prompt)."""
    a, b, c = prompts(seed, 3, 9 * BS)
    first, _ = run(core, a, 8, "A" if sessions else None)
    run(core, b, 8, "B" if sessions else None)
    run(core, c, 8, "C" if sessions else None)
    history = a + first + [5, 6, 7]
    second, cached = run(core, history, 8, "A" if sessions else None)
    return second, cached, history


def tier_counters(core: EngineCore, name: str):
    assert core.tiers is not None
    return core.tiers.stats().tiers[name]


@pytest.mark.parametrize("sessions", [True, False], ids=["session", "shared-prefix"])
def test_reloaded_kv_gives_the_tokens_of_a_recompute_and_of_no_eviction(tmp_path: Path, sessions: bool) -> None:
    loaded = tiny64()
    tiered = core_for(loaded, kv_offload_dir=str(tmp_path))
    got, cached, history = conversation(tiered, sessions)
    assert tier_counters(tiered, "disk").loaded_blocks > 0 and cached >= 8 * BS  # it came from the tier
    plain = core_for(loaded)
    recomputed, plain_cached, _ = conversation(plain, sessions)
    assert plain_cached == 0  # without the tier the pool had lost it
    assert got == recomputed == reference(loaded, history, 8)
    tiered.close_tiers()


def test_host_memory_tier_reloads_the_same_tokens() -> None:
    loaded = tiny64()
    core = core_for(loaded, kv_offload_bytes=64 << 20)
    got, cached, history = conversation(core, sessions=True)
    counters = tier_counters(core, "host")
    assert counters.loaded_blocks > 0 and counters.stored_blocks > 0 and cached >= 8 * BS
    assert got == reference(loaded, history, 8)
    stats = core.stats().kv_tiers
    assert stats.reload.count == counters.loaded_blocks  # each reload timed once


def test_the_disk_tier_survives_a_restart(tmp_path: Path) -> None:
    loaded = tiny64()
    first = core_for(loaded, kv_offload_dir=str(tmp_path))
    (a,) = prompts(3, 1, 9 * BS)
    turn1, _ = run(first, a, 8, "A")
    first.close_tiers()  # shutdown writes what the pool still holds
    again = core_for(loaded, kv_offload_dir=str(tmp_path))
    history = a + turn1 + [9]
    turn2, cached = run(again, history, 8, "A")
    assert cached >= 9 * BS and tier_counters(again, "disk").loaded_blocks >= 9
    assert turn2 == reference(loaded, history, 8)
    again.close_tiers()


def test_another_model_never_reads_the_files(tmp_path: Path) -> None:
    first = core_for(tiny64(), kv_offload_dir=str(tmp_path))
    (a,) = prompts(4, 1, 6 * BS)
    run(first, a, 4, "A")
    first.close_tiers()
    other = from_config(tiny_config(max_positions=1024), dtype=torch.float64, seed=1)
    core = core_for(other, kv_offload_dir=str(tmp_path))
    assert core.tiers is not None and core.tiers.disk is not None and len(core.tiers.disk.index) == 0
    got, cached = run(core, a + [7], 4, "A")
    assert cached == 0 and got == reference(other, a + [7], 4)
    core.close_tiers()


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_a_damaged_block_file_is_recomputed(tmp_path: Path, damage: str) -> None:
    loaded = tiny64()
    first = core_for(loaded, kv_offload_dir=str(tmp_path))
    (a,) = prompts(5, 1, 9 * BS)
    turn1, _ = run(first, a, 8, "A")
    first.close_tiers()
    core = core_for(loaded, kv_offload_dir=str(tmp_path))
    files = sorted(tmp_path.rglob("*.kv"))
    assert files
    for path in files:  # damaged under the running server, after it indexed them
        if damage == "corrupt":
            raw = bytearray(path.read_bytes())
            raw[-5] ^= 0x40
            path.write_bytes(bytes(raw))
        elif damage == "truncate":
            path.write_bytes(path.read_bytes()[:-100])
        else:
            path.unlink()
    history = a + turn1 + [9]
    got, _ = run(core, history, 8, "A")
    assert got == reference(loaded, history, 8)
    counters = tier_counters(core, "disk")
    assert counters.failed_loads > 0 and counters.loaded_blocks == 0
    core.close_tiers()


def test_a_full_tier_evicts_its_oldest_blocks_and_stays_exact(tmp_path: Path) -> None:
    loaded = tiny64()
    block_bytes = BS * 2 * 2 * 2 * 16 * 8  # tokens x K,V x layers x kv heads x head dim x float64
    core = core_for(loaded, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=3 * block_bytes)
    got, _, history = conversation(core, sessions=True)
    assert got == reference(loaded, history, 8)
    disk = core.tiers.disk  # type: ignore[union-attr]
    assert len(disk.index) <= 3 and len(list(disk.folder.glob("*.kv"))) <= 3
    assert disk.index.counters.evicted_blocks > 0
    core.close_tiers()


def test_one_identity_never_reads_another_identity_s_blocks(tmp_path: Path) -> None:
    loaded = tiny64()
    core = core_for(loaded, kv_offload_dir=str(tmp_path))
    a, b, c = prompts(6, 3, 9 * BS)
    run(core, a, 4, salt="alice")
    run(core, b, 4, salt="alice")
    run(core, c, 4, salt="alice")
    _, cached = run(core, a + [1], 4, salt="mallory")
    assert cached == 0
    _, cached = run(core, a + [1], 4, salt="alice")
    assert cached > 0
    core.close_tiers()


def session_info(core: EngineCore, session_id: str):  # noqa: ANN201
    reply = core.get_session(session_id)
    core.drain_inbox()
    return reply.result(timeout=0)


def test_get_session_reports_pool_and_tier_tokens_apart(tmp_path: Path) -> None:
    loaded = tiny64()
    core = core_for(loaded, kv_offload_dir=str(tmp_path))
    a, b, c = prompts(7, 3, 9 * BS)
    run(core, a, 8, "A")
    held = session_info(core, "A")
    assert held is not None and held.cached_tokens == 9 * BS + 7 and held.tier_tokens == 0
    run(core, b, 8, "B")
    run(core, c, 8, "C")
    gone = session_info(core, "A")
    assert gone is not None and gone.tier_tokens > 0 and gone.cached_tokens + gone.tier_tokens <= 9 * BS + 7
    core.close_tiers()


def test_bad_tier_settings_are_refused_at_start(tmp_path: Path) -> None:
    loaded = tiny64()
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    with pytest.raises(DiskTierError, match="--kv-offload-dir"):
        core_for(loaded, kv_offload_dir=str(not_a_folder / "sub"))
    with pytest.raises(DiskTierError, match="--kv-offload-disk-gib"):
        core_for(loaded, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=1000)
    with pytest.raises(ValueError, match="--kv-offload-gib"):
        core_for(loaded, kv_offload_bytes=1000)
    with pytest.raises(ValueError, match="prefix caching"):
        core_for(loaded, kv_offload_bytes=64 << 20, enable_prefix_caching=False)


def test_disk_tier_files_are_checked_whole(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, b"f" * 16, 10 * 64, 64)
    parent = prefix_root(None)
    tokens = tuple(range(BS))
    content = BlockContent(chain_hash(parent, tokens), parent, tokens)
    payload = bytes(range(64))
    assert tier.put(content, payload) and tier.get(content) == payload
    other = BlockContent(content.block_hash, parent, tuple(range(1, BS + 1)))  # same digest, other tokens
    assert tier.get(other) is None and tier.index.counters.failed_loads == 1
    assert tier.put(content, payload)
    reopened = DiskTier(tmp_path, b"f" * 16, 10 * 64, 64)
    assert reopened.open() == 1 and reopened.get(content) == payload
    foreign = DiskTier(tmp_path, b"g" * 16, 10 * 64, 64)
    assert foreign.open() == 0
    (tmp_path / (b"g" * 16).hex() / tier.path(content.block_hash).name).write_bytes(
        tier.path(content.block_hash).read_bytes()
    )
    assert foreign.open() == 0  # a file copied from another model's folder is not read


def test_tier_metrics_are_exported(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from llmserve.telemetry.metrics import _tier_metrics

    core = core_for(tiny64(), kv_offload_dir=str(tmp_path), kv_offload_bytes=64 << 20)
    conversation(core, sessions=True)
    stats = core.stats().kv_tiers

    class Tiers:
        def collect(self):  # noqa: ANN202
            return _tier_metrics(stats)

    registry = CollectorRegistry()
    registry.register(Tiers())
    text = generate_latest(registry).decode()
    host = stats.tiers["host"]
    assert f'llmserve_kv_tier_loaded_blocks_total{{tier="host"}} {float(host.loaded_blocks)}' in text
    assert 'llmserve_kv_tier_stored_blocks_total{tier="disk"}' in text
    assert f'llmserve_kv_tier_used_blocks{{tier="host"}} {float(len(core.tiers.host.index))}' in text  # type: ignore[union-attr]
    assert f"llmserve_kv_tier_reload_seconds_count {float(host.loaded_blocks)}" in text
    core.close_tiers()


def test_default_model_in_float32_reloads_the_tokens_of_a_recompute_and_of_no_eviction(
    real_model: LoadedModel, tmp_path: Path
) -> None:
    """SmolLM2 in float32: for a session and for a shared prefix, reload == recompute == no eviction."""
    small = dict(kv_cache_tokens=24 * BS, max_num_batched_tokens=256)
    for sessions in (True, False):
        tiered = core_for(real_model, kv_offload_dir=str(tmp_path / str(sessions)), **small)
        reloaded, cached, _ = conversation(tiered, sessions, seed=11)
        assert cached >= 8 * BS and tier_counters(tiered, "disk").loaded_blocks > 0
        tiered.close_tiers()
        recomputed, plain_cached, _ = conversation(core_for(real_model, **small), sessions, seed=11)
        assert plain_cached == 0
        kept, kept_cached, _ = conversation(core_for(real_model, kv_cache_tokens=200 * BS), sessions, seed=11)
        assert kept_cached >= 8 * BS  # a pool big enough that nothing was evicted
        assert reloaded == recomputed == kept


def test_writes_that_fail_under_the_server_are_counted_and_recomputed(tmp_path: Path) -> None:
    """The tier's folder vanishes while serving (as a full or failed disk would refuse writes): nothing is
    stored, nothing errs, the returning turn recomputes and gets the same tokens."""
    import shutil

    loaded = tiny64()
    core = core_for(loaded, kv_offload_dir=str(tmp_path / "tier"))
    shutil.rmtree(tmp_path / "tier")
    got, _, history = conversation(core, sessions=True)
    core.close_tiers()  # waits for the queued writes
    counters = tier_counters(core, "disk")
    assert counters.failed_stores > 0 and counters.stored_blocks == 0
    assert got == reference(loaded, history, 8)


def test_the_server_refuses_to_start_on_an_unwritable_tier_folder(tmp_path: Path) -> None:
    import subprocess
    import sys

    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    flags = ["--address", "127.0.0.1:0", "--metrics-port", "0", "--model", "random:tiny"]
    flags += ["--kv-offload-dir", str(not_a_folder / "sub")]  # refused before any model matters: the tiny one
    proc = subprocess.run([sys.executable, "-m", "llmserve", *flags], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2  # bad settings
    assert "--kv-offload-dir" in proc.stderr and "not a writable folder" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- planted collisions: a digest that matches a block whose recorded parent or tokens differ ------------------


def chain(prompt: list[int], salt: str | None = None) -> list[BlockContent]:
    """The contents of a prompt's full blocks, as the pool hashes them."""
    parent, blocks = prefix_root(salt), []
    for start in range(0, len(prompt) - BS + 1, BS):
        tokens = tuple(prompt[start : start + BS])
        blocks.append(BlockContent(chain_hash(parent, tokens), parent, tokens))
        parent = blocks[-1].block_hash
    return blocks


def collision(real: BlockContent, other: BlockContent, differs: str) -> BlockContent:
    """`real`'s digest recorded for `other`'s parent or tokens: what a digest collision would leave in a tier."""
    if differs == "parent":
        return BlockContent(real.block_hash, other.parent, real.tokens)
    return BlockContent(real.block_hash, real.parent, other.tokens)


PLANTED = 3  # the block of A's prompt whose digest is planted: the three before it come back, the rest recompute


@pytest.mark.parametrize("differs", ["parent", "tokens"])
def test_a_colliding_block_in_the_host_tier_is_a_miss_and_recomputed(differs: str) -> None:
    loaded = tiny64()
    core = core_for(loaded, kv_offload_bytes=64 << 20)
    a, b, c = prompts(11, 3, 9 * BS)
    first, _ = run(core, a, 8)
    run(core, b, 8)
    run(core, c, 8)
    host = core.tiers.host  # type: ignore[union-attr]
    assert host is not None
    blocks = chain(a)
    assert all(x.block_hash in host.index and not core.pool.holds(x.block_hash) for x in blocks[: PLANTED + 2])
    # The tier holds another block's KV (A's block 5) under block 3's digest, recorded with another parent or
    # other tokens, as if that block had been stored under a colliding digest.
    decoy = blocks[5]
    data = host.get(decoy)
    assert data is not None
    assert host.index.remove(blocks[PLANTED].block_hash)
    host.put(collision(blocks[PLANTED], decoy, differs), data)
    before = tier_counters(core, "host")
    loaded_before, hits_before, failed_before = before.loaded_blocks, before.hits, before.failed_loads
    history = a + first + [5, 6, 7]
    got, cached = run(core, history, 8)
    assert got == reference(loaded, history, 8)
    after = tier_counters(core, "host")
    assert cached == PLANTED * BS  # the prefix stops at the planted digest: from there on it is recomputed
    assert after.loaded_blocks - loaded_before == after.hits - hits_before == PLANTED
    assert after.failed_loads == failed_before  # a miss at lookup, not a load that failed
    core.close_tiers()


@pytest.mark.parametrize("differs", ["parent", "tokens"])
def test_a_colliding_block_file_in_the_disk_tier_is_a_miss_and_recomputed(tmp_path: Path, differs: str) -> None:
    loaded = tiny64()
    first_engine = core_for(loaded, kv_offload_dir=str(tmp_path))
    a, b, c = prompts(12, 3, 9 * BS)
    first, _ = run(first_engine, a, 8)
    run(first_engine, b, 8)
    run(first_engine, c, 8)
    first_engine.close_tiers()  # every block on disk
    disk = first_engine.tiers.disk  # type: ignore[union-attr]
    assert disk is not None
    blocks = chain(a)
    decoy = blocks[5]
    payload = disk.get(decoy)
    assert payload is not None
    # A well-formed file of this model (fingerprint, checksum) under block 3's digest, whose header records
    # another parent or other tokens and holds another block's KV: a restart indexes it as it says.
    assert disk.put(collision(blocks[PLANTED], decoy, differs), payload)
    core = core_for(loaded, kv_offload_dir=str(tmp_path))
    history = a + first + [5, 6, 7]
    got, cached = run(core, history, 8)
    assert got == reference(loaded, history, 8)
    counters = tier_counters(core, "disk")
    assert cached == PLANTED * BS
    assert counters.loaded_blocks == counters.hits == PLANTED and counters.failed_loads == 0
    core.close_tiers()


@pytest.mark.parametrize("differs", ["parent", "tokens"])
def test_each_tier_serves_a_block_only_for_the_parent_and_tokens_it_recorded(tmp_path: Path, differs: str) -> None:
    """The checks one by one, without a model: the index's lookup and each tier's read compare the recorded
    parent and tokens, not the digest alone."""
    from llmserve.engine.backends.base import BlockData
    from llmserve.engine.kv_tiers.host import HostTier
    from llmserve.engine.kv_tiers.index import TierIndex

    real, other = chain(list(range(3, 3 + 2 * BS)))
    planted = collision(real, other, differs)
    index = TierIndex(10 * 64, 64)
    index.add(planted)
    assert not index.has(real.block_hash, real.parent, real.tokens)
    assert index.has(planted.block_hash, planted.parent, planted.tokens)
    assert (index.counters.hits, index.counters.misses) == (1, 1)
    host = HostTier(10 * 64, 64)
    host.put(planted, BlockData(torch.zeros(16, dtype=torch.float32)))
    assert host.get(real) is None and host.get(planted) is not None
    disk = DiskTier(tmp_path, b"f" * 16, 10 * 64, 64)
    assert disk.put(planted, bytes(range(64)))
    assert disk.get(real) is None and disk.index.counters.failed_loads == 1
