"""Overlapped decode steps (engine/overlap.py, ``async_scheduling``): the next decode step launched on
the previous one's samples while they are still on the device gives what one step at a time gives, and
no block is reused while a step in flight may still write it."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import abort_in_flight_and_finish, add_prefilled

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine

KW = dict(dtype="float32", device="cpu", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256)


def _prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 900, (int(k),), generator=g).tolist() for k in torch.randint(3, 60, (n,), generator=g)]


def _params(stops: list[int] | None = None) -> list[SamplingParams]:
    """Greedy and seeded requests with different lengths, logprobs, min_tokens and stop tokens."""
    stops = stops or [None] * 6  # type: ignore[list-item]
    out = []
    for i in range(6):
        kw: dict = dict(max_tokens=5 + 4 * i, logprobs=2, ignore_eos=True)
        if i % 2:
            kw.update(temperature=0.8, top_p=0.9, seed=100 + i)
        else:
            kw.update(temperature=0.0)
        if stops[i] is not None:
            kw.update(stop_token_ids=[stops[i]], min_tokens=2)
        out.append(SamplingParams(**kw))
    return out


def _run(tiny_model, overlap: bool, params: list[SamplingParams]) -> tuple[list, int]:
    with LLM(str(tiny_model), async_scheduling=overlap, **KW) as llm:
        outs = llm.generate(_prompts(), params)
        assert llm.engine.num_used_blocks == 0
        assert llm.engine.scheduler.num_deferred == 0
        return outs, llm.engine.overlapped_steps


def test_overlapped_decode_equals_one_step_at_a_time(tiny_model) -> None:
    ref, n_ref = _run(tiny_model, False, _params())
    assert n_ref == 0
    # Stop tokens taken from the plain run's outputs, so requests end early (after min_tokens) with rows
    # already launched past their end.
    stops = [o.token_ids[len(o.token_ids) // 2] if i in (0, 3, 4) else None for i, o in enumerate(ref)]
    params = _params(stops)
    want, _ = _run(tiny_model, False, params)
    got, n = _run(tiny_model, True, params)
    assert n > 10  # most decode steps were launched on the device's tokens
    assert any(len(w.token_ids) < p.max_tokens for w, p in zip(want, params))  # some stopped early
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == w.finish_reason
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)  # a batch with other rows rounds otherwise


def test_blocks_freed_while_a_step_is_in_flight_wait_for_it(tiny_model) -> None:
    """An abort while a decode step is in flight keeps the request's blocks until that step has run;
    then every block is free again."""
    with LLM(str(tiny_model), async_scheduling=True, **KW) as llm:
        eng: LLMEngine = llm.engine
        sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        seqs = [eng.add_request(p, sp) for p in _prompts(3)]
        for _ in range(6):
            eng.step()
        assert eng.overlapped_steps > 0 and eng.has_unfinished()
        abort_in_flight_and_finish(eng, seqs, 40)


def test_requests_that_need_their_last_token_run_one_step_at_a_time(tiny_model) -> None:
    """A penalty counts the output so far: such a batch is never overlapped, and its output is as before."""
    sp = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)
    outs = {}
    for overlap in (False, True):
        with LLM(str(tiny_model), async_scheduling=overlap, **KW) as llm:
            outs[overlap] = [o.token_ids for o in llm.generate(_prompts(3), sp)]
            assert llm.engine.overlapped_steps == 0
    assert outs[True] == outs[False]


def _admit_while_decoding(tiny_model, overlap: bool) -> tuple[list[list[int]], int, int]:
    """A decode engine that admits prefilled requests (KV copied from a prefill engine, as a pull
    would) every few steps while it decodes the others."""
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_model), **KW) as prefill, LLM(str(tiny_model), async_scheduling=overlap, **KW) as decode:
        pe, de = prefill.engine, decode.engine
        src, dst = pe.executor.cache.layers, de.executor.cache.layers
        seqs, steps = [], 0
        for i, prompt in enumerate(_prompts(5)):
            first = pe.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id=f"r{i}",
                                   hold_kv=True)
            while pe.has_unfinished():
                pe.step()
            held = pe.held[f"r{i}"].block_ids

            def fill(blocks: list[int], held: list[int] = held) -> list[int]:
                for layer, t in dst.items():
                    t[blocks] = src[layer][held]
                return blocks

            seqs.append(add_prefilled(de, prompt, first.output_token_ids[0], sp, fill, request_id=f"r{i}"))
            assert pe.release(f"r{i}")
            for _ in range(3):
                de.step()
                steps += 1
        while de.has_unfinished():
            de.step()
            steps += 1
        assert de.num_used_blocks == 0 and pe.num_used_blocks == 0
        return [q.output_token_ids for q in seqs], de.overlapped_steps, steps


def test_admitted_requests_join_an_overlapped_batch(tiny_model) -> None:
    """On a decode node requests arrive while others decode: each joins the next overlapped step with
    its first token (from the prefill node) on the host, and the outputs are those of one step at a time."""
    want, n_ref, _ = _admit_while_decoding(tiny_model, False)
    got, n, steps = _admit_while_decoding(tiny_model, True)
    assert n_ref == 0 and got == want
    assert n >= steps - 4  # admissions did not break the overlap (the first step and the drain excepted)


def test_one_token_prompt_chunks_beside_decodes_are_not_decode_rows(tiny_model) -> None:
    """With a budget of 3 tokens, two decoding requests leave one row for a waiting prompt: a step of
    three one-row entries, one of them a prompt chunk that samples nothing. It must not be taken for a
    decode step to run on (nor may a prompt's last row, whose prompt logprobs are asked for)."""
    kw = {**KW, "max_num_batched_tokens": 3, "max_num_seqs": 3}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 900, (n,), generator=g).tolist() for n in (2, 3, 10)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outs = {}
    for overlap in (False, True):
        with LLM(str(tiny_model), async_scheduling=overlap, **kw) as llm:
            res = llm.generate(prompts, sp)
            outs[overlap] = [(o.token_ids, len(o.prompt_logprobs or [])) for o in res]
            assert llm.engine.num_used_blocks == 0
    assert outs[True] == outs[False]
    assert [n for _, n in outs[True]] == [2, 3, 10]


def test_a_request_that_cannot_follow_keeps_the_batch_one_step_at_a_time(tiny_model) -> None:
    """A penalty among plain requests: the batch is not overlapped while it runs (leaving it out of the
    fed steps would give it a token only every other step), so every request still gets a token a step."""
    plain = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    penalised = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, frequency_penalty=0.5)
    params = [plain, plain, penalised, plain]
    outs, steps = {}, {}
    for overlap in (False, True):
        with LLM(str(tiny_model), async_scheduling=overlap, **KW) as llm:
            eng = llm.engine
            seqs = [eng.add_request(p, sp) for p, sp in zip(_prompts(4), params)]
            steps[overlap] = 0
            while eng.has_unfinished():
                eng.step()
                steps[overlap] += 1
            outs[overlap] = [q.output_token_ids for q in seqs]
            assert eng.overlapped_steps == 0 and eng.num_used_blocks == 0
    assert outs[True] == outs[False]
    assert steps[True] == steps[False] <= 31
