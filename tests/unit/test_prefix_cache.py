"""Automatic prefix caching (``engine.prefix_cache``): the block pool's accounting, and greedy outputs
equal with and without it (shared prefixes, chunked prefill, preemption under memory pressure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.block_hash import block_hash, prompt_block_hashes
from engine.kv_cache import BlockAllocator
from engine.parallel.kv_layout import ShardedBlockAllocator
from engine.prefix_cache import PrefixCache

KW = dict(dtype="float32", device="cpu", max_model_len=512)
SYSTEM = [(i * 13 + 7) % 900 + 2 for i in range(100)]  # 6 full blocks of 16 and 4 tokens
PROMPTS = [SYSTEM + [(i * k + 3) % 900 + 2 for i in range(10 + 7 * k)] for k in range(1, 7)] + [SYSTEM[:50]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1)


def test_hashes_chain_from_the_start() -> None:
    a = prompt_block_hashes(list(range(40)), 16)
    assert len(a) == 2 and a[1] == block_hash(a[0], list(range(16, 32)))
    b = prompt_block_hashes([99] + list(range(1, 40)), 16)
    assert b[0] != a[0] and b[1] != a[1]  # a different first block changes every later hash


def test_the_pool_counts_references_keeps_unused_cached_blocks_and_evicts_least_recent_first() -> None:
    cache = PrefixCache(BlockAllocator(4))
    a = cache.allocate(2)
    cache.register(a[0], 10)
    cache.register(a[1], 11)
    assert cache.match([10, 11, 12]) == a  # a second user of both
    cache.free(a)
    assert (cache.num_used, cache.num_cached) == (2, 0)  # still used once
    cache.free(a)
    assert (cache.num_used, cache.num_free, cache.num_cached) == (0, 4, 2)
    b = cache.allocate(2)  # the allocator's own free blocks first: the cache keeps both
    assert cache.num_cached == 2 and cache.match([10]) == [a[0]]
    cache.free([a[0]])  # a[0] is now the most recently used cached block
    c = cache.allocate(1)  # no free block left: evicts the least recently used (a[1])
    assert c == [a[1]] and cache.match([10, 11]) == [a[0]]
    cache.free([a[0]])
    cache.free(b + c)
    with pytest.raises(ValueError):
        cache.free(c)  # freed twice
    cache.reset()
    assert (cache.num_used, cache.num_cached, cache.inner.num_free) == (0, 0, 4)


def test_sharded_ranks_report_cached_blocks_as_not_used() -> None:
    cache = PrefixCache(ShardedBlockAllocator(4, pcp=2, block_size=16, interleave=16))
    ids = cache.allocate(4)  # logical blocks 0..3 alternate owners
    for j, b in enumerate(ids):
        cache.register(b, 100 + j)
    assert cache.used_per_rank() == [2, 2]
    cache.free(ids)
    assert cache.used_per_rank() == [0, 0] and cache.num_cached == 4


def run(model: Path, prompts: list[list[int]], passes: int = 2, **kw: object) -> tuple[list, LLM]:
    llm = LLM(str(model), **KW, **kw)
    outs = []
    for _ in range(passes):
        outs.append([(o.token_ids, o.logprobs) for o in llm.generate(prompts, [GREEDY] * len(prompts))])
    return outs, llm


@pytest.mark.parametrize("budget", [2048, 48], ids=["one-step", "chunked"])
def test_greedy_outputs_are_the_same_with_prefix_caching(tiny_model: Path, budget: int) -> None:
    (want,), plain = run(tiny_model, PROMPTS, passes=1, max_num_batched_tokens=budget)
    plain.shutdown()
    outs, llm = run(tiny_model, PROMPTS, enable_prefix_caching=True, max_num_batched_tokens=budget)
    try:
        for got in outs:  # the first pass shares the system prompt, the second hits whole prompts
            assert [t for t, _ in got] == [t for t, _ in want]
            for (_, lp), (_, ref) in zip(got, want):
                assert lp == pytest.approx(ref, abs=1e-4)
        cache = llm.engine.prefix_cache
        assert cache is not None and cache.hits >= 6 * len(PROMPTS)
        # Every block is free or cached afterwards, none in use.
        assert llm.engine.num_used_blocks == 0 and cache.num_cached > 0
        assert cache.num_free == cache.inner.num_free + cache.num_cached
    finally:
        llm.shutdown()


def test_preemption_and_eviction_under_memory_pressure_keep_outputs_equal(tiny_model: Path) -> None:
    long = [SYSTEM + [(i * k + 5) % 900 + 2 for i in range(120)] for k in range(1, 5)]
    (want,), plain = run(tiny_model, long, passes=1, num_kv_blocks=40)
    plain.shutdown()
    outs, llm = run(tiny_model, long, enable_prefix_caching=True, num_kv_blocks=40)  # 4 x 14 blocks > 40
    try:
        for got in outs:
            assert [t for t, _ in got] == [t for t, _ in want]
        assert llm.engine.num_used_blocks == 0
    finally:
        llm.shutdown()


def test_requests_that_want_prompt_logprobs_compute_their_whole_prompt(tiny_model: Path) -> None:
    with LLM(str(tiny_model), **KW, enable_prefix_caching=True) as llm:
        params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
        first = llm.generate([PROMPTS[0]], params)[0]
        again = llm.generate([PROMPTS[0]], params)[0]
        assert len(again.prompt_logprobs) == len(PROMPTS[0])
        assert again.prompt_logprobs[1:] == pytest.approx(first.prompt_logprobs[1:], abs=1e-5)
        assert llm.engine.prefix_cache.hits == 0


def test_the_cache_reports_what_it_stored_and_evicted_since_it_was_last_asked() -> None:
    pool = PrefixCache(BlockAllocator(2))
    a, b = pool.allocate(2)
    pool.register(a, 101)
    pool.register(b, 102)
    assert pool.take_events() == ([101, 102], [])
    assert pool.take_events() == ([], [])
    pool.free([a, b])
    (c,) = pool.allocate(1)  # no free block: evicts the least recent cached one (101)
    pool.register(c, 103)
    assert pool.take_events() == ([103], [101])
    pool.free([c])
    pool.reset()
    assert sorted(pool.take_events()[1]) == [102, 103]
