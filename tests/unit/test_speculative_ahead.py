"""Speculative decoding's steps launched ahead (``async_scheduling``, on by default on a GPU: ``LLMEngine.spec_ahead``):
once a step's tokens are verified and its next drafts made, ``finish_step`` schedules and launches the next step
before the caller delivers the finished ones. What that must not change: every request's tokens, finish reason and
logprobs (greedy and seeded, stop tokens, min_tokens, penalties) equal one step at a time; a request aborted
while a step is launched keeps its blocks until that step has run; every block is free at the end. The hand-off
path (a decode side verifying the prefill side's draft first) with it: test_speculative.py's ``both-ahead``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import abort_in_flight_and_finish

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from pdctl.tiny_model import make_tiny_model

KW = dict(dtype="float32", device="cpu", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("ahead") / "v3-mtp", arch="v3", moe=True, seed=7, mtp_layers=1)


def _prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 900, (int(k),), generator=g).tolist() for k in torch.randint(3, 60, (n,), generator=g)]


def _params(stops: list[int | None]) -> list[SamplingParams]:
    """Greedy, seeded and penalised requests of different lengths, with logprobs, min_tokens and stop tokens."""
    out = []
    for i, stop in enumerate(stops):
        kw: dict = dict(max_tokens=6 + 5 * i, logprobs=2, ignore_eos=True)
        if i % 2:
            kw.update(temperature=0.8, top_p=0.9, seed=100 + i)
        else:
            kw.update(temperature=0.0)
        if i == 4:
            kw.update(repetition_penalty=1.2)
        if stop is not None:
            kw.update(stop_token_ids=[stop], min_tokens=3)
        out.append(SamplingParams(**kw))
    return out


def _run(model: Path, ahead: bool, params: list[SamplingParams], k: int = 2) -> tuple[list, LLMEngine]:
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": k})
    with LLM(str(model), async_scheduling=ahead, speculative_config=spec, **KW) as llm:
        outs = llm.generate(_prompts(), params)
        eng = llm.engine
        assert eng.num_used_blocks == 0 and eng.scheduler.num_deferred == 0
        return outs, eng


@pytest.mark.parametrize("k", [1, 3])
def test_steps_launched_ahead_equal_one_step_at_a_time(mtp_model: Path, k: int) -> None:
    first, _ = _run(mtp_model, False, _params([None] * 6), k)
    # Stop tokens from that run's outputs: requests end early, after min_tokens, inside a verify step's tokens.
    stops = [o.token_ids[len(o.token_ids) // 2] if i in (0, 3, 4) else None for i, o in enumerate(first)]
    params = _params(stops)
    want, plain = _run(mtp_model, False, params, k)
    got, eng = _run(mtp_model, True, params, k)
    assert plain.ahead_steps == 0 and eng.ahead_steps > 10
    assert eng.spec_counts.steps > 10 and eng.spec_counts.draft_tokens > 0
    assert any(len(w.token_ids) < p.max_tokens for w, p in zip(want, params))  # some stopped early
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == w.finish_reason
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)  # a batch with other rows rounds otherwise


def test_an_abort_while_a_step_is_launched_ahead_keeps_its_blocks_until_it_has_run(mtp_model: Path) -> None:
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    with LLM(str(mtp_model), async_scheduling=True, speculative_config=spec, **KW) as llm:
        eng: LLMEngine = llm.engine
        sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        seqs = [eng.add_request(p, sp) for p in _prompts(3)]
        for _ in range(5):
            eng.step()
        assert eng.ahead_steps > 0 and eng._launched is not None and eng._launched.ahead
        abort_in_flight_and_finish(eng, seqs, 40)
