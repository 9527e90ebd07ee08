"""Book-keeping for the fixed pool of KV blocks: reference counts, free lists and prefix hashes.

No tensors live here; the backend owns the KV memory and this class only says which block ids are whose.
A block is in exactly one of four states:
- owned: ref_count > 0 (held by running sequences and/or sessions, or by waiting sequences that pin it while
  their other blocks load);
- loading: owned, and its KV is being read back from a lower tier (kv_tiers); the load holds one reference
  until `end_load`, which registers the block's hash when the KV arrived sound;
- cached: ref_count == 0 but its content is known by a prefix hash, so a later request may revive it;
  cached blocks are evicted least recently freed first when fresh blocks are needed;
- free: ref_count == 0 and no hash.
A prefix whose block was evicted may live on "in a lower tier": that state belongs to the tier's index (by
digest), not to a block id. With `track_evictions`, each evicted cached block is listed (`take_evicted`) so
that its KV is copied out to the tier before the block is written again.

A block's prefix hash is a 128-bit BLAKE2b digest over its parent's digest and its own tokens, chained from a
root that carries the cache salt. A prompt cannot be crafted to collide with another caller's block, and a hit
is still checked against the block's recorded parent and tokens, so even a collision could not serve KV that
is not the prompt's own. The digests are stable across processes (no per-process key): a lower KV tier may
keep blocks under them across a restart.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from llmserve.engine.sched.kv_events import KvEventLog
from llmserve.engine.types.kv_cache import UNKNOWN_SALT, blocks_for

BlockHash = bytes  # 16 bytes: see chain_hash
_DIGEST_BYTES = 16


@dataclass(slots=True, frozen=True)
class BlockContent:
    """What a hashed block holds: its digest, its parent's digest and its own tokens (one block's worth)."""

    block_hash: BlockHash
    parent: BlockHash
    tokens: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class Evicted:
    """A cached block the pool just handed out again: its KV still holds `content` until the next forward."""

    block: int
    content: BlockContent


class NoFreeBlocks(RuntimeError):
    """Raised by allocate() when fewer blocks are free than asked for; callers check can_allocate first."""


def prefix_root(salt: str | None) -> BlockHash:
    """The parent of a prompt's first block: one root per cache salt, so salts never share a block."""
    data = b"llmserve.prefix.v1" if salt is None else b"llmserve.prefix.v1\x00salt\x00" + salt.encode()
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()


_UNSALTED_ROOT = prefix_root(None)


def chain_hash(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """Digest of a full block given its parent's digest (None: the unsalted root), so equal digests mean
    equal prefixes. Tokens are hashed as fixed-width integers: no two token lists share an encoding."""
    digest = hashlib.blake2b(_UNSALTED_ROOT if parent is None else parent, digest_size=_DIGEST_BYTES)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


class BlockPool:
    """A fixed set of `num_blocks` KV blocks of `block_size` token slots each."""

    def __init__(
        self, num_blocks: int, block_size: int, *, track_evictions: bool = False, events: KvEventLog | None = None
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # What a hashed block holds, checked on every hit: its parent's digest and its own tokens.
        self._content: list[tuple[BlockHash, tuple[int, ...]] | None] = [None] * num_blocks
        self._hash_to_block: dict[BlockHash, int] = {}
        self.num_hash_mismatches = 0  # hits whose content differed from the prompt's: never reused
        # Pop from the end; reversed so that low ids come out first (nicer to read in tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()
        self.track_evictions = track_evictions
        self._evicted: list[Evicted] = []
        self._loading: set[int] = set()
        # With `events`: each hashed block's cache salt, so that its stored and removed events name it.
        self.events = events
        self._salt: list[str | None] = [None] * num_blocks

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that allocate() can hand out now (free plus evictable cached ones)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for their prefix hash (part of num_free)."""
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold `num_tokens` tokens."""
        return blocks_for(num_tokens, self.block_size)

    def lookup(self, block_hash: BlockHash, parent: BlockHash | None, tokens: Sequence[int]) -> int | None:
        """The block, owned or cached, that holds exactly these tokens after this parent, if any.

        `block_hash` is chain_hash(parent, tokens) (parent None: the unsalted root); the block's recorded content
        is compared too, so a digest that matched by collision is a miss (and counted in num_hash_mismatches)."""
        block = self._hash_to_block.get(block_hash)
        if block is None:
            return None
        if self._content[block] != (parent or _UNSALTED_ROOT, tuple(tokens)):
            self.num_hash_mismatches += 1
            return None
        return block

    # -- changes ---------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Hand out `n` blocks with ref_count 1, evicting cached blocks (oldest first) if needed."""
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} blocks, {self.num_free} free")
        out: list[int] = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._cached.popitem(last=False)
                content = self.content(block) if self.track_evictions else None
                if content is not None:
                    self._evicted.append(Evicted(block, content))
                self._forget_hash(block)
            self.ref_count[block] = 1
            out.append(block)
        return out

    def acquire(self, blocks: Iterable[int]) -> None:
        """Add a reference to blocks that are owned or cached (reviving cached ones)."""
        for block in blocks:
            if self.ref_count[block] == 0:
                if block not in self._cached:
                    raise ValueError(f"block {block} is free; allocate it instead")
                del self._cached[block]
            self.ref_count[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; unreferenced blocks become cached (if hashed) or free."""
        for block in blocks:
            count = self.ref_count[block]
            if count <= 0:
                raise ValueError(f"block {block} released more often than acquired")
            self.ref_count[block] = count - 1
            if count == 1:
                if self.block_hash[block] is not None:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def register(
        self,
        block: int,
        block_hash: BlockHash,
        parent: BlockHash | None,
        tokens: Sequence[int],
        salt: str | None = UNKNOWN_SALT,
    ) -> None:
        """Record that an owned, full block holds `tokens` after the prefix `parent`, with this hash (its chain
        hashed under `salt`, for the events).

        If another block already holds that prefix, the first one stays the canonical copy and this
        block stays anonymous (it is freed normally).
        """
        if self.ref_count[block] <= 0:
            raise ValueError(f"block {block} is not owned")
        if self.block_hash[block] is not None or block_hash in self._hash_to_block:
            return
        self.block_hash[block] = block_hash
        self._content[block] = (parent or _UNSALTED_ROOT, tuple(tokens))
        if self.events is not None:
            # A parent the pool holds is named; a chain's root (or a parent already evicted) is not a block.
            held = None if parent is None else self._hash_to_block.get(parent)
            if salt == UNKNOWN_SALT and held is not None:
                salt = self._salt[held]  # a block reloaded from a tier: its chain's salt is its parent's
            self._salt[block] = salt
            self.events.stored(block_hash, None if held is None else parent, tuple(tokens), salt)
        self._hash_to_block[block_hash] = block

    def holds(self, block_hash: BlockHash) -> bool:
        """Whether some block (owned or cached) holds the prefix with this digest."""
        return block_hash in self._hash_to_block

    def content(self, block: int) -> BlockContent | None:
        """What a hashed block holds, or None for an anonymous one."""
        block_hash, content = self.block_hash[block], self._content[block]
        if block_hash is None or content is None:
            return None
        return BlockContent(block_hash, *content)

    def take_evicted(self) -> list[Evicted]:
        """The hashed blocks evicted since the last call (with `track_evictions`), oldest first. Their KV must be
        read before the next forward, which may overwrite it."""
        out, self._evicted = self._evicted, []
        return out

    def is_loading(self, block: int) -> bool:
        return block in self._loading

    def begin_load(self, n: int) -> list[int]:
        """Allocate `n` blocks for KV that a lower tier is reading back; each stays loading (one reference held
        by the load) until `end_load`."""
        blocks = self.allocate(n)
        self._loading.update(blocks)
        return blocks

    def end_load(self, block: int, content: BlockContent | None) -> None:
        """The load into `block` is over: with `content` (the KV arrived and was checked) the block now holds
        that prefix; with None it failed and the block stays anonymous. The load's reference is dropped."""
        if block not in self._loading:
            raise ValueError(f"block {block} is not loading")
        self._loading.remove(block)
        if content is not None:
            self.register(block, content.block_hash, content.parent, content.tokens)
        self.release([block])

    def _forget_hash(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            if self.events is not None:
                self.events.removed(block_hash, self._salt[block])
            del self._hash_to_block[block_hash]
            self.block_hash[block] = None
            self._content[block] = None
