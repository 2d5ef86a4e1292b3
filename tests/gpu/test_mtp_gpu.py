"""Speculative decoding with the MTP layer on a GPU, CUDA graphs on: a step's verify rows replay from the graphs
of token rows (each a decode row attending up to its own position) and the MTP passes, replayed from graphs of
their own (``engine.mtp_graphs``), draft from the replay's hidden states.

bf16 rounds a step of 2 or 3 rows per request differently from a step of one, so outputs are compared as
tests/gpu/test_cuda_graphs.py compares replays: with the fp32 CPU engine without drafts, over each
request's tokens up to where it leaves that reference's greedy tokens. Drafting with graphs must follow it
at least half as far as an eager bf16 engine without drafts does (broken verify rows leave it at once), with
logprob errors at most twice eager's plus 0.05. Drafts from the reference's own continuation must be all
accepted while the run follows it, and wrong ones all rejected.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.speculative import draft_budget
from pdctl.tiny_model import make_tiny_model

pytestmark = pytest.mark.gpu
KW = dict(dtype="bfloat16", device="cuda", max_model_len=512, max_num_seqs=8, gpu_memory_utilization=0.3,
          max_cudagraph_capture_size=32)
LENGTHS = (3, 17, 40, 70, 130, 9)
PARAMS = SamplingParams(max_tokens=32, temperature=0.0, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mtp") / "v3-mtp", arch="v3", moe=True, seed=7, mtp_layers=1)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(4, 1000, (n,), generator=g).tolist() for n in LENGTHS]


def _spec(k: int) -> str:
    return json.dumps({"method": "mtp", "num_speculative_tokens": k})


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def runs(mtp_model: Path) -> dict:
    with LLM(str(mtp_model), **{**KW, "device": "cpu", "dtype": "float32"}) as cpu:
        ref = cpu.generate(_prompts(), PARAMS)
    with LLM(str(mtp_model), enforce_eager=True, **KW) as eager:
        want = eager.generate(_prompts(), PARAMS)
    return {"ref": ref, "eager": want}


def _compare(runs: dict, got: list) -> int:
    """Tokens ``got`` follows the reference over all requests; asserts the logprob bound."""
    followed = {"eager": 0, "got": 0}
    for i, (r, e, g) in enumerate(zip(runs["ref"], runs["eager"], got)):
        ne, ng = _first_diff(r.token_ids, e.token_ids), _first_diff(r.token_ids, g.token_ids)
        followed["eager"] += ne
        followed["got"] += ng
        n = min(ne, ng)
        err_e = max((abs(a - b) for a, b in zip(r.logprobs[:n], e.logprobs[:n])), default=0.0)
        err_g = max((abs(a - b) for a, b in zip(r.logprobs[:n], g.logprobs[:n])), default=0.0)
        assert err_g <= 2 * err_e + 0.05, (i, n, err_g, err_e)
    assert followed["got"] >= 0.5 * followed["eager"] > 0, followed
    return followed["got"]


@pytest.mark.parametrize("k", [1, 2])
def test_drafting_with_graphs_follows_the_fp32_reference_as_far_as_eager_decoding(mtp_model: Path, runs: dict,
                                                                                   k: int) -> None:
    with LLM(str(mtp_model), speculative_config=_spec(k), **KW) as llm:
        graphs = llm.engine.executor.graphs
        assert graphs is not None and graphs.sizes  # captured with speculative decoding on
        got = llm.generate(_prompts(), PARAMS)
        counts = llm.engine.spec_counts
        assert counts.steps > 0 and counts.draft_tokens > 0
        assert graphs.prefill_replays > 0  # verify steps were replays (rows of one request from a graph)
        mtp = llm.engine.executor.runner.mtp_graphs
        assert mtp is not None and mtp.replays > 0  # and the MTP passes after them replays of their own graphs
        assert llm.engine.ahead_steps > 0  # async_scheduling (a GPU's default): steps launched after the drafts
        assert llm.engine.num_used_blocks == 0
    _compare(runs, got)


@pytest.mark.parametrize("wrong", [False, True], ids=["all-right", "all-wrong"])
def test_oracle_drafts_with_graphs(mtp_model: Path, runs: dict, wrong: bool) -> None:
    """Drafts from the reference's continuation (k = 3): each verify step's rows replayed from a graph give
    the target's tokens, so the right drafts are accepted (until the run leaves the reference) and wrong
    ones never."""
    k = 3
    future = {tuple(p): r.token_ids for p, r in zip(_prompts(), runs["ref"])}
    with LLM(str(mtp_model), speculative_config=_spec(k), **KW) as llm:
        engine = llm.engine

        def oracle(step: object, ahead: bool = False) -> None:
            for seq in engine.scheduler.running:
                if seq.num_remaining != 1:
                    continue
                n = draft_budget(seq, k, engine.max_model_len)
                done = len(seq.output_token_ids)
                ahead = future[tuple(seq.prompt_token_ids)][done : done + n]
                seq.drafts = [(t + 1) % 1000 if wrong else t for t in ahead]

        engine._draft = oracle  # type: ignore[method-assign]
        got = llm.generate(_prompts(), PARAMS)
        c = engine.spec_counts
        assert engine.executor.graphs is not None and engine.executor.graphs.prefill_replays > 0
        assert engine.num_used_blocks == 0
    followed = _compare(runs, got)
    if wrong:
        assert c.accepted_tokens == 0
    else:
        # every token the run shares with the reference came from a right draft or a bonus: few steps each
        assert c.accepted_tokens >= 0.5 * followed, (c, followed)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_a_step_nobody_drafts_after_is_done_when_it_returns(mtp_model: Path, eager: bool) -> None:
    """The MTP pass after a step at which every request finished writes those requests' blocks, and nothing reads
    drafts to the host to wait for it: the engine frees the blocks right after, and a decode node may hand them to
    a KV pull the stream does not order. So the step returns with the GPU done (ModelRunner.draft)."""
    with LLM(str(mtp_model), enforce_eager=eager, **{**KW, "speculative_config": _spec(1)}) as llm:
        eng = llm.engine
        for prompt in _prompts()[:4]:
            eng.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        finished_last = False
        while eng.has_unfinished():
            done = eng.step()
            finished_last = not eng.has_unfinished() and bool(done)
        assert finished_last
        assert torch.cuda.current_stream().query(), "the last step's MTP pass was still running on the GPU"
