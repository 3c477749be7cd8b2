"""The prefix cache's bookkeeping (ring/prefix_cache.py): matching, holding, least-recently-used
eviction, and, over thousands of random requests sharing prefixes at random depths with random
aborts and a pool small enough to evict, that a match only ever returns blocks whose contents
are that prefix, every block stays in exactly one state, two pools fed the same calls agree, and
everything released leaves the pool whole."""

from __future__ import annotations

import random

import pytest

from ring.prefix_cache import ROOT, PrefixCache, block_key, extend_keys
from stages.batch import BLOCK_SIZE


def fill(cache: PrefixCache, tokens: list[int]) -> tuple[list[int], list[int]]:
    """A request's prompt through the pool as a scheduler would: its cached prefix held, the
    rest allocated, every full block committed. Returns (its blocks, the matched ones)."""
    matched = match(cache, tokens)
    cache.acquire(matched)
    needed = -(-len(tokens) // BLOCK_SIZE) - len(matched)
    blocks = matched + cache.allocate(needed)
    keys = extend_keys([], tokens)
    for i in range(len(matched), len(keys)):
        cache.commit(blocks[i], keys[i])
    return blocks, matched


def match(cache: PrefixCache, tokens: list[int]) -> list[int]:
    """The cached blocks of `tokens`' prefix, its last token left to compute (as the scheduler
    asks)."""
    return cache.match(extend_keys([], tokens[:-1]))


def test_a_released_prefix_is_matched_and_reused() -> None:
    cache = PrefixCache(8)
    prompt = list(range(40))  # two full blocks and 8 tokens
    blocks, matched = fill(cache, prompt)
    assert matched == [] and len(blocks) == 3
    cache.release(blocks)
    assert cache.num_cached == 2 and cache.num_available == 8
    again, matched = fill(cache, prompt + [99])
    assert matched == blocks[:2]  # the two full blocks, not the partial third
    assert again[:2] == blocks[:2]
    cache.release(again)
    cache.check()
    assert cache.is_whole()


def test_the_last_token_of_a_prompt_is_never_matched() -> None:
    cache = PrefixCache(4)
    prompt = list(range(2 * BLOCK_SIZE))
    blocks, _ = fill(cache, prompt)
    cache.release(blocks)
    matched = match(cache, prompt)  # both blocks cached, but the last token must be computed
    assert matched == blocks[:1]
    matched = match(cache, prompt + [7])
    assert matched == blocks


def test_idle_blocks_are_evicted_least_recently_released_first() -> None:
    cache = PrefixCache(4)
    first, _ = fill(cache, list(range(17)))  # one full block (cached) and one partial
    second, _ = fill(cache, list(range(100, 117)))
    cache.release(first)
    assert cache.num_available == 2  # first's two (one cached idle, one free)
    cache.release(second)
    fresh = cache.allocate(3)  # the free ones go first, then the oldest idle block (first's)
    assert first[0] in fresh and second[0] not in fresh
    assert match(cache, list(range(18))) == []  # evicted: its key is gone
    assert match(cache, list(range(100, 118))) == [second[0]]
    cache.release(fresh)
    cache.check()


def test_a_matched_idle_block_counts_against_what_is_available() -> None:
    cache = PrefixCache(2)
    prompt = list(range(BLOCK_SIZE + 1))
    blocks, _ = fill(cache, prompt)
    cache.release(blocks)  # one cached idle block, one free
    matched = match(cache, prompt)
    assert matched == blocks[:1] and cache.num_available == 2
    # holding the match takes the idle block out of the evictable ones: one fresh block left
    assert cache.fits(matched, 1) and not cache.fits(matched, 2)
    assert cache.fits([], 2)


def test_two_requests_filling_one_prefix_keep_one_copy() -> None:
    cache = PrefixCache(6)
    prompt = list(range(BLOCK_SIZE + 1))
    a, _ = fill(cache, prompt)
    b, matched = fill(cache, prompt)  # a still running: its block is cached and held
    assert matched == [a[0]] and b[0] == a[0]
    cache.release(a)
    cache.release(b)
    cache.check()
    assert cache.num_cached == 1 and cache.is_whole()


def test_misuse_is_one_error_each() -> None:
    cache = PrefixCache(2)
    with pytest.raises(RuntimeError, match="released more often"):
        cache.release([0])
    with pytest.raises(RuntimeError, match="available"):
        cache.allocate(3)
    with pytest.raises(RuntimeError, match="not held"):
        cache.commit(1, block_key(ROOT, list(range(BLOCK_SIZE))))
    with pytest.raises(ValueError, match="16 tokens"):
        block_key(ROOT, [1, 2, 3])
    held = cache.allocate(1)
    with pytest.raises(RuntimeError, match="still held"):
        cache.clear()
    cache.release(held)
    cache.clear()
    assert cache.is_whole() and cache.num_cached == 0


def test_keys_chain_their_whole_prefix() -> None:
    a = block_key(ROOT, list(range(BLOCK_SIZE)))
    b = block_key(ROOT, list(range(1, BLOCK_SIZE + 1)))
    assert a != b and len(a) == 16
    # the same tokens after another parent are another block
    assert block_key(a, list(range(BLOCK_SIZE))) != block_key(b, list(range(BLOCK_SIZE)))
    assert block_key(a, list(range(BLOCK_SIZE))) == block_key(a, list(range(BLOCK_SIZE)))
    tokens = list(range(3 * BLOCK_SIZE + 5))
    keys = extend_keys([], tokens[: BLOCK_SIZE + 5])
    assert keys == [a]
    assert extend_keys(keys, tokens[BLOCK_SIZE:]) is keys and len(keys) == 3  # whole blocks
    assert keys[2] == block_key(keys[1], tokens[2 * BLOCK_SIZE : 3 * BLOCK_SIZE])


def test_forgetting_idle_blocks_frees_them_and_keeps_held_ones() -> None:
    cache = PrefixCache(6)
    a, _ = fill(cache, list(range(2 * BLOCK_SIZE + 1)))
    b, _ = fill(cache, list(range(100, 100 + BLOCK_SIZE + 1)))
    cache.release(a)
    assert cache.forget_idle() == 2
    assert match(cache, list(range(2 * BLOCK_SIZE + 1))) == []
    assert match(cache, list(range(100, 100 + BLOCK_SIZE + 1))) == b[:1]  # held: kept
    cache.release(b)
    cache.check()
    assert cache.is_whole()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_requests_sharing_prefixes_keep_every_invariant(seed: int) -> None:
    rng = random.Random(seed)
    pools = [PrefixCache(48), PrefixCache(48)]  # two stages fed the same calls
    contents: dict[int, list[int]] = {}  # the prefix stage 0's block holds the KV of
    # a few shared "system prompts" and their continuations; two repeat one block of tokens
    # after different prefixes (the same 16 tokens at depth 0 and 1, or after another block),
    # which only the chain of keys tells apart
    roots = [[rng.randrange(1000) for _ in range(rng.randrange(16, 80))] for _ in range(4)]
    motif = [rng.randrange(1000) for _ in range(BLOCK_SIZE)]
    roots += [motif * 3 + roots[0][:20], roots[1][:BLOCK_SIZE] + motif + roots[2][:20]]
    running: list[tuple[list[int], list[int]]] = []  # (tokens, blocks)
    hits = 0
    for _step in range(3000):
        if running and (rng.random() < 0.45 or not pools[0].num_available):
            tokens, blocks = running.pop(rng.randrange(len(running)))  # finishes or aborts
            for pool in pools:
                pool.release(blocks)
        else:
            root = rng.choice(roots)
            tokens = root[: rng.randrange(len(root) + 1)] + [
                rng.randrange(1000) for _ in range(rng.randrange(1, 40))
            ]
            needed = -(-len(tokens) // BLOCK_SIZE)
            matched = match(pools[0], tokens)
            if not pools[0].fits(matched, needed - len(matched)):
                continue  # would not fit: a scheduler would wait (or retract)
            results = [fill(pool, tokens) for pool in pools]
            assert results[0] == results[1]  # the same ids, the same matches, everywhere
            blocks, matched = results[0]
            # a hit's KV is that of exactly this prefix, up to its block's end (not only its own
            # 16 tokens: the keys before them shaped its values)
            for i, block in enumerate(matched):
                assert contents[block] == tokens[: (i + 1) * BLOCK_SIZE]
            hits += len(matched)
            for i in range(len(matched), len(blocks)):
                contents[blocks[i]] = tokens[: (i + 1) * BLOCK_SIZE]
            running.append((tokens, blocks))
        for pool in pools:
            pool.check()
    assert hits > 100  # the shared prefixes were found
    for _, blocks in running:
        for pool in pools:
            pool.release(blocks)
    for pool in pools:
        pool.check()
        assert pool.is_whole()
