"""The KV block pool of the scheduler replica, keeping the contents of full blocks for reuse
(the prefix cache; torch-free bookkeeping, the storage is the stage's).

A block that a request has filled (16 tokens) is keyed by a hash chain: its key is a 128-bit
BLAKE2b digest of its parent block's key and its own token ids, so a key names the whole prefix
up to and including that block, as vLLM's automatic prefix caching keys its blocks. A chain and
not a radix tree: every lookup is a walk of a prompt's full blocks from the first, which is all a
prompt needs; a digest is the same in every process (Python's `hash` of a tuple is too, for
ints, but 64 bits and not a promise across versions), and a key never outlives its meaning: a
tree keyed by parent block ids would have to drop every descendant of an evicted block, or a
new block under a recycled id could match a stale child.

A block is in exactly one of three states: free (never filled, or evicted), held (reference
count > 0: running requests read or write it), or cached and idle (count 0, its contents kept,
evictable, least recently released first). Every stage runs an identical pool fed the same calls
in the same order (the replicated scheduler), so block ids, matches and evictions agree without
being sent.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence

from stages.batch import BLOCK_SIZE

ROOT = b""  # the parent key of a prompt's first block
# ... of a LongRoPE sequence computed at the long factors: the same tokens, other K and V
ROOT_ROPE_LONG = b"rope-long"


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block holding `tokens` (BLOCK_SIZE ids) after the block keyed `parent`
    (ROOT for the first): 16 bytes, the same in every process."""
    if len(tokens) != BLOCK_SIZE:
        raise ValueError(f"a cached block holds {BLOCK_SIZE} tokens, got {len(tokens)}")
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(struct.pack(f"<{BLOCK_SIZE}q", *tokens))
    return digest.digest()


def extend_keys(keys: list[bytes], tokens_after: Sequence[int], root: bytes = ROOT) -> list[bytes]:
    """`keys` (those of a sequence's first full blocks, or empty) extended in place by the keys
    of the full blocks of `tokens_after`, the tokens that follow those blocks (a partial last
    block has none); returns it. A request keeps its keys: they depend on its tokens alone (and
    `root`, the first block's parent), so each is computed once."""
    for start in range(0, len(tokens_after) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = keys[-1] if keys else root
        keys.append(block_key(parent, tokens_after[start : start + BLOCK_SIZE]))
    return keys


class PrefixCache:
    """`num_blocks` KV blocks, each free, held or cached (see the module docstring)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs: dict[int, int] = {}  # held blocks -> their holders
        self._key_of: dict[int, bytes] = {}  # cached blocks (held or idle) -> key
        self._block_of: dict[bytes, int] = {}  # and back
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unheld: oldest first

    # -- what a scheduler asks ------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Blocks `allocate` can hand out now: the free ones and the idle cached ones (evicted
        on demand)."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of `keys` (a prompt's, from `extend_keys`) from
        the first. Takes no reference: `acquire` them before anything else can evict them. The
        caller leaves a prompt's last token out of `keys`' blocks (its logits are needed)."""
        blocks: list[int] = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def fits(self, matched: Sequence[int], num_new: int) -> bool:
        """Whether a request can hold `matched` (from `match`) and `num_new` fresh blocks: an
        idle block it matches stops being evictable once held, so it counts against the
        available ones too (admission must not count it twice)."""
        idle = sum(1 for block in matched if block in self._idle)
        return num_new <= self.num_available - idle

    def acquire(self, blocks: Sequence[int]) -> None:
        """One more holder of each of `blocks` (cached ones `match` returned)."""
        for block in blocks:
            if block not in self._key_of and block not in self._refs:
                raise RuntimeError(f"KV block {block} is neither cached nor held")
            held = self._refs.get(block, 0)
            if held == 0:
                self._idle.pop(block, None)
            self._refs[block] = held + 1

    def allocate(self, num_blocks: int) -> list[int]:
        """`num_blocks` fresh blocks, one holder each: free ones first, then idle cached ones,
        least recently released first (their keys dropped)."""
        if num_blocks > self.num_available:
            raise RuntimeError(
                f"asked for {num_blocks} KV blocks, {self.num_available} are available"
            )
        blocks = []
        for _ in range(num_blocks):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._idle.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def commit(self, block: int, key: bytes) -> None:
        """`block`, held and now full, is cached under `key` (from `extend_keys`). Where another
        block already holds that key (two requests filled the same prefix at once), that one
        stays the cached copy and `block` stays uncached, freed when released."""
        if block not in self._refs:
            raise RuntimeError(f"KV block {block} is committed but not held")
        if block in self._key_of:
            if self._key_of[block] != key:
                raise RuntimeError(f"KV block {block} is already cached under another prefix")
            return
        if key not in self._block_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def release(self, blocks: Sequence[int]) -> None:
        """One holder fewer of each of `blocks`; a block nobody holds is idle if cached (last in
        eviction order), else free."""
        for block in blocks:
            held = self._refs.get(block, 0)
            if held <= 0:
                raise RuntimeError(f"KV block {block} released more often than held")
            if held > 1:
                self._refs[block] = held - 1
                continue
            del self._refs[block]
            if block in self._key_of:
                self._idle[block] = None
            else:
                self._free.append(block)

    def clear(self) -> None:
        """Forget every cached block (a new ring epoch: the KV cache was lost with its stages).
        Held blocks must have been released first."""
        if self._refs:
            raise RuntimeError(f"{len(self._refs)} KV blocks are still held")
        self.forget_idle()

    def forget_idle(self) -> int:
        """Drop every idle cached block's contents (they become free); returns how many (`clear`,
        and the test hook that makes one stage's cache differ from the others')."""
        forgotten = len(self._idle)
        for block in self._idle:
            del self._block_of[self._key_of.pop(block)]
        self._free.extend(self._idle)
        self._idle.clear()
        return forgotten

    # -- invariants (tests, and a stage at idle) -------------------------------------------------

    def is_whole(self) -> bool:
        """No block held, and every block either free or cached and idle, once."""
        return not self._refs and len(self._free) + len(self._idle) == self.num_blocks

    def check(self) -> None:
        """Raise if the three states overlap or miss a block, or the key maps disagree."""
        free, held, idle = set(self._free), set(self._refs), set(self._idle)
        if len(free) != len(self._free):
            raise AssertionError("a block is free twice")
        if free & held or free & idle or held & idle:
            raise AssertionError("a block is in two states")
        if free | held | idle != set(range(self.num_blocks)):
            raise AssertionError("a block is in no state")
        if any(n <= 0 for n in self._refs.values()):
            raise AssertionError("a held block has no holder")
        if not idle <= set(self._key_of):
            raise AssertionError("an idle block is not cached")
        if free & set(self._key_of):
            raise AssertionError("a free block is still cached")
        if {b: k for k, b in self._block_of.items()} != self._key_of:
            raise AssertionError("the key maps disagree")
