"""Which KV blocks each request holds: bookkeeping only (the storage is stages/kv_cache.py).

Every stage runs an identical allocator over the agreed block count, fed the same calls in the
same order, so block ids agree across stages without ever being sent.
"""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} KV blocks, {len(self._free)} are free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        self._in_use.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if block not in self._in_use:
                raise RuntimeError(f"KV block {block} freed twice or never allocated")
            self._in_use.remove(block)
            self._free.append(block)

    def is_whole(self) -> bool:
        """Every block is free again (the invariant at idle)."""
        return not self._in_use and len(self._free) == self.num_blocks
