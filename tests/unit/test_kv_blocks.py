"""Exact KV block accounting: every block is free once requests finish, abort or get preempted."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import add_prefilled

from engine import LLM, SamplingParams
from engine.kv_cache import BlockAllocator


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 1000, (n,), generator=g).tolist() for n in lengths]


def test_allocator_accounting() -> None:
    a = BlockAllocator(8)
    ids = a.allocate(5)
    assert (a.num_used, a.num_free) == (5, 3)
    assert not a.can_allocate(4)
    with pytest.raises(MemoryError):
        a.allocate(4)
    a.free(ids[:2])
    with pytest.raises(ValueError, match="freed twice"):
        a.free(ids[:1])
    a.free(ids[2:])
    assert (a.num_used, a.num_free) == (0, 8)


def test_all_blocks_free_after_requests_finish(tiny_model) -> None:
    with LLM(str(tiny_model), dtype="float32", max_model_len=512, block_size=16) as llm:
        eng = llm.engine
        total = eng.scheduler.allocator.num_free  # all free before any request
        seqs = [eng.add_request(p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
                for p in _prompts((3, 17, 64, 100))]
        eng.step()
        # Each running request holds exactly ceil(computed tokens / block_size) blocks.
        assert eng.num_used_blocks == sum(-(-s.num_computed // 16) for s in seqs) > 0
        while eng.has_unfinished():
            eng.step()
        assert eng.num_used_blocks == 0
        assert eng.scheduler.allocator.num_free == total


def test_abort_frees_blocks(tiny_model) -> None:
    with LLM(str(tiny_model), dtype="float32", max_model_len=512) as llm:
        eng = llm.engine
        seqs = [eng.add_request(p, SamplingParams(max_tokens=50)) for p in _prompts((30, 200))]
        eng.step()
        assert eng.num_used_blocks > 0
        for s in seqs:
            assert eng.abort(s.request_id)
        assert not eng.abort(seqs[0].request_id)  # unknown now
        assert eng.num_used_blocks == 0
        assert not eng.has_unfinished()


def test_preemption_keeps_outputs_and_frees_blocks(tiny_model) -> None:
    """A cache too small for all requests at once forces recompute preemption; outputs are unchanged."""
    prompts = _prompts((60, 60, 60, 60), seed=5)
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_model), dtype="float32", max_model_len=128) as roomy:
        ref = [o.token_ids for o in roomy.generate(prompts, sp)]
    with LLM(str(tiny_model), dtype="float32", max_model_len=128, block_size=16, num_kv_blocks=14) as tight:
        got = [o.token_ids for o in tight.generate(prompts, sp)]
        assert tight.engine.num_used_blocks == 0
    assert got == ref


def test_abort_between_launch_and_finish_of_a_step(tiny_model) -> None:
    with LLM(str(tiny_model), dtype="float32", device="cpu", max_model_len=256) as llm:
        eng = llm.engine
        seq = eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0))
        eng.launch_step()
        assert eng.abort(seq.request_id)
        assert eng.finish_step() == []
        assert seq.finish_reason == "abort" and seq.output_token_ids == []
        assert eng.num_used_blocks == 0 and not eng.has_unfinished()


def test_add_prefilled_frees_its_blocks_unless_the_transfer_succeeds(tiny_model) -> None:
    prompt = [5, 6, 7, 8] * 10
    with LLM(str(tiny_model), dtype="float32", device="cpu", max_model_len=256) as llm:
        eng = llm.engine

        def broken(ids: list[int]) -> list[int]:
            raise RuntimeError("source gone")

        with pytest.raises(RuntimeError, match="source gone"):
            add_prefilled(eng, prompt, 9, SamplingParams(max_tokens=4), broken, request_id="x")
        with pytest.raises(ValueError, match="block table"):
            add_prefilled(eng, prompt, 9, SamplingParams(max_tokens=4), lambda ids: [ids[0]] * len(ids))
        assert eng.num_used_blocks == 0 and not eng.has_unfinished()
        done = add_prefilled(eng, prompt, 9, SamplingParams(max_tokens=1), lambda ids: ids[::-1])
        assert done.finish_reason == "length" and done.output_token_ids == [9]
        assert eng.num_used_blocks == 0
        seq = add_prefilled(eng, prompt, 9, SamplingParams(max_tokens=3, temperature=0.0), lambda ids: ids, "y")
        while eng.has_unfinished():
            eng.step()
        assert len(seq.output_token_ids) == 3 and seq.output_token_ids[0] == 9
        assert eng.num_used_blocks == 0


def test_transferred_requests_never_exceed_max_num_seqs(tiny_model) -> None:
    """A decode engine with max_num_seqs 1 runs admitted transfers one at a time (the others wait,
    counted as waiting, their blocks kept), and each ends as it would alone."""
    prompts = _prompts((40, 17, 33), seed=3)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_model), dtype="float32", device="cpu", max_model_len=256) as ref, \
            LLM(str(tiny_model), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=1) as llm:
        want = [o.token_ids for o in ref.generate(prompts, params)]
        src, eng = ref.engine, llm.engine
        seqs = []
        for i, p in enumerate(prompts):
            held = src.add_request(p, SamplingParams(max_tokens=1, temperature=0.0), request_id=f"s{i}", hold_kv=True)
            while src.has_unfinished():
                src.step()

            def fill(ids: list[int], rid: str = f"s{i}") -> list[int]:
                for layer, cache in eng.cache_layers.items():
                    cache[ids] = src.cache_layers[layer][src.held[rid].block_ids]
                return ids

            seqs.append(add_prefilled(eng, p, held.output_token_ids[0], params, fill, request_id=f"d{i}"))
            src.release(f"s{i}")
        assert len(eng.scheduler.waiting) == 3 and not eng.scheduler.running
        most = 0
        while eng.has_unfinished():
            eng.step()
            most = max(most, len(eng.scheduler.running))
        assert most == 1, "more transferred requests ran at once than max_num_seqs"
        assert [s.output_token_ids for s in seqs] == want
        assert eng.num_used_blocks == 0
