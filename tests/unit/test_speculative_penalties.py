"""Speculative decoding for requests with penalties (presence, frequency, repetition) and with a ``min_tokens``
still to reach (``engine.speculative``): verify row i is penalised with the output so far and the drafts
``d1..di`` counted, and bans the stop tokens while ``len(output) + i < min_tokens``, as decoding one token at
a time would. Greedy outputs and logprobs equal decoding without drafts, whatever the drafts (the MTP
layer's, the known continuation, wrong ones); seeded sampled requests stay reproducible."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from test_speculative import Oracle as SpecOracle

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.llm import RequestOutput
from engine.llm_engine import LLMEngine
from engine.logits_processors import apply_bias_and_penalties
from engine.sequence import Sequence
from engine.speculative import _chosen_logits
from engine.structured_output import Grammar, GuidanceTokenizers, StructuredOutputsParams
from engine.tokenizer import Tokenizer
from pdctl.tiny_model import make_tiny_model

KW = dict(dtype="float32", device="cpu", max_model_len=512)
LENGTHS = (3, 17, 40, 70, 9)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
KINDS = {"presence": dict(presence_penalty=1.5), "frequency": dict(frequency_penalty=0.9),
         "repetition": dict(repetition_penalty=1.8),
         "all": dict(presence_penalty=0.7, frequency_penalty=0.5, repetition_penalty=1.4, logit_bias={7: 2.0})}
MIN_TOKENS = 16


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("spec-pen") / "v3-mtp", arch="v3", moe=True, seed=7, mtp_layers=1)


def spec(k: int) -> str:
    return json.dumps({"method": "mtp", "num_speculative_tokens": k})


def prompts() -> list[list[int]]:
    """Each penalty kind's five prompts (a first token of its own: the prompts are the oracle's keys), then the
    two min_tokens requests'."""
    g = torch.Generator().manual_seed(0)
    base = [torch.randint(4, 1000, (n,), generator=g).tolist() for n in LENGTHS]
    return [[1000 + j] + p for j in range(len(KINDS)) for p in base] + [[1010] + base[4], [1011] + base[2]]


@pytest.fixture(scope="module")
def plain(mtp_model: Path) -> list[list[int]]:
    """Greedy outputs without penalties or drafts."""
    with LLM(str(mtp_model), **KW) as llm:
        return [o.token_ids for o in llm.generate(prompts(), GREEDY)]


@pytest.fixture(scope="module")
def batch(plain: list[list[int]]) -> list[SamplingParams]:
    """Each penalty kind over five prompts, then two requests whose min_tokens bans a token (a stop token id, with
    eos) their plain outputs take third, so they would stop there: one without penalties, one with them all."""
    params = [dataclasses.replace(GREEDY, **kw) for kw in KINDS.values() for _ in LENGTHS]  # type: ignore[arg-type]
    for out, kw in zip(plain[-2:], ({}, KINDS["all"])):
        params.append(dataclasses.replace(GREEDY, ignore_eos=False, min_tokens=MIN_TOKENS, stop_token_ids=[out[2]],
                                          **kw))  # type: ignore[arg-type]
    return params


@pytest.fixture(scope="module")
def reference(mtp_model: Path, plain: list[list[int]], batch: list[SamplingParams]) -> list[RequestOutput]:
    """The batch decoded without drafts: each penalty kind changes some outputs, min_tokens both of its own."""
    with LLM(str(mtp_model), **KW) as llm:
        outs = llm.generate(prompts(), batch)
    changed = [o.token_ids != p for o, p in zip(outs, plain)]
    assert all(any(changed[j * len(LENGTHS) : (j + 1) * len(LENGTHS)]) for j in range(len(KINDS)))
    for o, p in zip(outs[-2:], plain[-2:]):
        assert p[2] not in o.token_ids[:MIN_TOKENS] and len(o.token_ids) >= MIN_TOKENS  # banned until then
    return outs


def same(got: list[RequestOutput], want: list[RequestOutput]) -> None:
    """Tokens and finish reasons equal, logprobs (the chosen ones and the top 3) within 1e-5."""
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
        assert g.top_logprobs is not None and w.top_logprobs is not None
        for gt, wt in zip(g.top_logprobs, w.top_logprobs):
            assert sorted(gt) == sorted(wt) and gt == pytest.approx(wt, abs=1e-5)


def record_drafting(engine: LLMEngine) -> set[str]:
    """The requests that had drafts to verify at some step."""
    drafted: set[str] = set()
    draft = engine._draft

    def recording(step: object, ahead: bool = False) -> None:
        draft(step, ahead)  # type: ignore[arg-type]
        drafted.update(q.request_id for q in engine.scheduler.running if q.drafts)

    engine._draft = recording  # type: ignore[method-assign]
    return drafted


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_penalised_and_min_tokens_requests_draft_and_equal_decoding_without(
        mtp_model: Path, batch: list[SamplingParams], reference: list[RequestOutput], k: int) -> None:
    with LLM(str(mtp_model), speculative_config=spec(k), **KW) as llm:
        drafted = record_drafting(llm.engine)
        outs = llm.generate(prompts(), batch)
        c = llm.engine.spec_counts
        assert c.steps > 0 and 0 < c.draft_tokens <= c.steps * k
        assert len(drafted) == len(batch)  # every request drafted
        assert llm.engine.num_used_blocks == 0
    same(outs, reference)


class Oracle(SpecOracle):
    """Drafts from the known continuation: right ones, or wrong ones (a token the request's min_tokens bans at
    its row while it does, else the next id)."""

    def wrong_drafts(self, seq: Sequence, done: int, future: list[int]) -> list[int]:
        stops = seq.params.stop_token_ids or []
        return [stops[0] if stops and done + i < seq.params.min_tokens and stops[0] != t else (t + 1) % 1000
                for i, t in enumerate(future)]


@pytest.mark.parametrize("wrong", [False, True], ids=["all-right", "all-wrong"])
def test_right_drafts_are_all_accepted_and_wrong_ones_none(
        mtp_model: Path, batch: list[SamplingParams], reference: list[RequestOutput],
        wrong: bool) -> None:
    """Right drafts are accepted only if each row counts the drafts before it (a row penalised by the output
    alone would choose a token the reference's penalties ruled out); wrong ones, the min_tokens request's
    banned stop token among them, never."""
    k = 3
    with LLM(str(mtp_model), speculative_config=spec(k), **KW) as llm:
        engine = llm.engine
        engine._draft = Oracle(engine, {tuple(p): r.token_ids for p, r in zip(prompts(), reference)}, k,  # type: ignore
                               wrong)
        outs = llm.generate(prompts(), batch)
        c = engine.spec_counts
        if wrong:
            assert c.draft_tokens > 0 and c.accepted_tokens == 0
        else:
            assert c.accepted_tokens == c.draft_tokens > 0 and c.mean_accepted_length > 3
        assert engine.num_used_blocks == 0
    same(outs, reference)


def test_seeded_sampled_penalised_requests_draft_and_stay_reproducible(mtp_model: Path,
                                                                        plain: list[list[int]]) -> None:
    kinds = [kw for kw in KINDS.values() for _ in LENGTHS] + [{}, KINDS["all"]]
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=3 + i, ignore_eos=True, **kw)  # type: ignore
              for i, kw in enumerate(kinds[:-2])]
    params += [SamplingParams(max_tokens=24, temperature=0.8, seed=i, min_tokens=MIN_TOKENS, stop_token_ids=[out[2]],
                              **kw) for i, (out, kw) in enumerate(zip(plain[-2:], kinds[-2:]))]  # type: ignore
    runs = []
    for _ in range(2):
        with LLM(str(mtp_model), speculative_config=spec(2), **KW) as llm:
            drafted = record_drafting(llm.engine)
            runs.append([o.token_ids for o in llm.generate(prompts(), params)])
            assert llm.engine.spec_counts.draft_tokens > 0 and len(drafted) == len(params)
    assert runs[0] == runs[1]
    for out, p in zip(runs[0][-2:], plain[-2:]):
        assert len(out) >= MIN_TOKENS and p[2] not in out[:MIN_TOKENS]


def test_rows_of_one_request_count_the_drafts_before_each_as_output() -> None:
    """``apply_bias_and_penalties`` with ``ahead``: a request's rows, row i with the drafts d1..di, equal the
    rows of requests whose outputs already hold them; a neighbour's row is its own."""
    v = 64
    logits = torch.randn(5, v, generator=torch.Generator().manual_seed(1)) * 3
    params = SamplingParams(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.7, logit_bias={3: 1.5})
    seq = Sequence("a", [1, 2, 3, 60, 70], params, max_tokens=16, output_token_ids=[5, 6, 5])
    other = Sequence("b", [9], SamplingParams(frequency_penalty=1.0), max_tokens=16, output_token_ids=[9, 9])
    drafts = [6, 7, 5]
    got = apply_bias_and_penalties(logits, [seq] * 4 + [other], [drafts[:i] for i in range(4)] + [[]])
    for i in range(4):
        alone = Sequence("a", seq.prompt_token_ids, params, max_tokens=16, output_token_ids=[5, 6, 5] + drafts[:i])
        assert torch.equal(got[i], apply_bias_and_penalties(logits[i : i + 1], [alone])[0]), i
    assert torch.equal(got[4], apply_bias_and_penalties(logits[4:], [other])[0])
    assert not torch.equal(got[0], got[1])  # (the drafts moved the counts)


def test_min_tokens_bans_the_stop_tokens_at_the_rows_short_of_it_unless_the_grammar_accepts_there(
        mtp_model: Path) -> None:
    """``_chosen_logits``: row i bans the stop tokens (``stop_token_ids`` and eos) while len(output) + i <
    min_tokens, as the sampler does, but not where the grammar accepts the output after d1..di (the sampler's
    exception: the grammar decides there); the matcher ends where it began."""
    tok = Tokenizer(str(mtp_model))
    mc = ModelConfig.from_pretrained(str(mtp_model))
    guidance = GuidanceTokenizers(tok, mc.vocab_size, mc.eos_token_ids)
    ids = [tok.encode(ch)[-1] for ch in "123-abcd"]
    c, eos = ids[6], mc.eos_token_ids[0]
    logits = torch.zeros(4, mc.vocab_size)
    inf = float("-inf")

    def rows(min_tokens: int, grammar: bool) -> torch.Tensor:
        so = StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,6}") if grammar else None
        params = SamplingParams(min_tokens=min_tokens, max_tokens=32, stop_token_ids=[c], structured_outputs=so)
        seq = Sequence("g", [5, 6], params, max_tokens=32, eos_token_ids=mc.eos_token_ids)
        if so is not None:
            seq.grammar = Grammar(guidance.get(), so)
            for t in ids[:4]:  # "123-" taken
                assert seq.grammar.advance(t)
        seq.output_token_ids = ids[:4]
        out = _chosen_logits([(seq, logits, ids[4:7])])[0]  # drafts "a", "b", "c": accepting after "ab"
        if seq.grammar is not None:
            assert not seq.grammar.accepting and seq.grammar.matcher.validate_tokens(ids[4:7]) == 3  # (unmoved)
        return out

    assert rows(20, False)[:, c].tolist() == [inf] * 4 and rows(20, False)[:, eos].tolist() == [inf] * 4
    assert rows(6, False)[:, c].tolist() == [inf, inf, 0, 0]  # 4 + i < 6 at rows 0 and 1
    assert rows(0, False)[:, c].tolist() == [0] * 4
    g = rows(20, True)
    assert g[:, c].tolist() == [inf, inf, 0, 0]  # "123-", "123-a" not accepting; "123-ab", "123-abc" accepting
    assert g[:, eos].tolist() == [inf, inf, 0, 0]  # (before: the grammar's mask and the ban; after: neither)


def test_a_transferred_penalised_request_verifies_the_prefill_sides_draft(
        mtp_model: Path, batch: list[SamplingParams], reference: list[RequestOutput]) -> None:
    """A prefill node's held request with penalties (or min_tokens) drafts once for the decode side, which
    verifies that draft at its first step (its rows penalised with the first token counted) and drafts on:
    outputs equal decoding in one engine without drafts."""
    picks = [0, 7, 13, 19, 20, 21]  # presence, frequency, repetition, all, both min_tokens requests
    with LLM(str(mtp_model), speculative_config=spec(2), **KW) as p_llm, \
            LLM(str(mtp_model), speculative_config=spec(2), **KW) as d_llm:
        p_eng, d_eng = p_llm.engine, d_llm.engine
        seqs = []
        for i in picks:
            prompt, params = prompts()[i], batch[i]
            once = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))  # (prefill_node's)
            held = p_eng.add_request(prompt, once, request_id=f"r{i}", hold_kv=True)
            while not held.is_finished:
                p_eng.step()
            assert held.drafts
            seq = d_eng.begin_prefilled(prompt, params, request_id=f"r{i}")
            for layer, cache in d_eng.cache_layers.items():  # the transfer: every layer's KV, the MTP layer's too
                cache[seq.block_ids] = p_eng.cache_layers[layer][held.block_ids]
            assert not d_eng.admit_prefilled(seq, list(seq.block_ids), held.output_token_ids[0],
                                             held.logprobs[0] if held.logprobs else float("nan"),
                                             drafts=list(held.drafts))
            assert seq.drafts == held.drafts[:1]
            assert p_eng.release(f"r{i}")
            seqs.append(seq)
        d_eng.step()
        assert d_eng.spec_counts.steps == len(picks)  # each verified the prefill side's draft
        while d_eng.has_unfinished():
            d_eng.step()
        assert [s.output_token_ids for s in seqs] == [reference[i].token_ids for i in picks]
        assert p_eng.num_used_blocks == 0 and d_eng.num_used_blocks == 0
