"""Speculative decoding for requests with a grammar (structured output) or a logit bias (``engine.speculative``):
the grammar checks the MTP layer's drafts (one it forbids ends them) and masks each verify row by its state after
the drafts before it. Greedy outputs equal decoding without drafts token for token, whatever the drafts (the
model's own, the known continuation, ones the grammar forbids), every output parses or matches; seeded sampled
requests stay reproducible; every block is freed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.llm_engine import LLMEngine
from engine.scheduler import Scheduled
from engine.sequence import Sequence
from engine.structured_output import Grammar, GuidanceTokenizers, StructuredOutputsParams, mask_drafted, mask_logits
from engine.tokenizer import Tokenizer
from pdctl.tiny_model import make_tiny_model

KW = dict(dtype="float32", device="cpu", max_model_len=512)

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]},
                   "size": {"type": "integer", "minimum": 0, "maximum": 999},
                   "name": {"type": "string", "maxLength": 10}},
    "required": ["color", "size", "name"], "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,6}"
CHOICES = ["yes", "no", "maybe so"]
# One constraint per prompt (the prompts are the oracles' keys).
CASES: list[tuple[str | list[int], StructuredOutputsParams]] = [
    ("Give me JSON:", StructuredOutputsParams(json=SCHEMA)),
    ([5, 9, 300, 7], StructuredOutputsParams(json=SCHEMA)),
    ("hello world", StructuredOutputsParams(regex=REGEX)),
    ("the cat sat", StructuredOutputsParams(regex=REGEX)),
    ("answer:", StructuredOutputsParams(choice=CHOICES)),
    ([11, 12, 13], StructuredOutputsParams(choice=CHOICES)),
]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("spec-grammar") / "v3-mtp", arch="v3", moe=True, seed=7,
                           mtp_layers=1)


def spec(k: int) -> str:
    return json.dumps({"method": "mtp", "num_speculative_tokens": k})


def params(temperature: float = 0.0, seed: int | None = None) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=64, temperature=temperature, seed=None if seed is None else seed + i,
                           structured_outputs=c) for i, (_, c) in enumerate(CASES)]


PROMPTS = [p for p, _ in CASES]


def check(texts: list[str]) -> None:
    """Every output is what its constraint allows (the corpus is bounded: each one completes)."""
    for text, (_, c) in zip(texts, CASES):
        if c.json is not None:
            jsonschema.validate(json.loads(text), SCHEMA)
        elif c.regex is not None:
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES


@pytest.fixture(scope="module")
def reference(mtp_model: Path) -> list[list[int]]:
    """Greedy outputs without speculative decoding."""
    with LLM(str(mtp_model), **KW) as llm:
        outs = llm.generate(PROMPTS, params())
    assert all(o.finish_reason == "stop" for o in outs)
    check([o.text for o in outs])
    return [o.token_ids for o in outs]


def key(seq: Sequence) -> tuple[int, ...]:
    return tuple(seq.prompt_token_ids)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_grammar_requests_draft_and_equal_decoding_without(mtp_model: Path, reference: list[list[int]],
                                                                   k: int) -> None:
    """Only grammar requests run, so the counts are theirs: drafts were made, cut by the grammar and verified."""
    with LLM(str(mtp_model), speculative_config=spec(k), **KW) as llm:
        outs = llm.generate(PROMPTS, params())
        c = llm.engine.spec_counts
        assert [o.token_ids for o in outs] == reference
        check([o.text for o in outs])
        assert c.steps > 0 and c.draft_tokens >= c.steps and c.draft_tokens <= c.steps * k
        assert llm.engine.num_used_blocks == 0


class OracleDrafter:
    """The engine's drafter (the MTP layer still runs, for its KV) with the drafts it makes replaced by the
    known continuation; from ``bad_at`` on, a token the grammar forbids there."""

    def __init__(self, engine: LLMEngine, reference: dict[tuple[int, ...], list[int]],
                 bad_at: int | None = None) -> None:
        assert engine.drafts is not None
        self.engine, self.inner, self.reference, self.bad_at = engine, engine.drafts.executor, reference, bad_at

    def draft(self, next_ids: list[int], picks: list[int], extra: list[int],
              tables: list[list[int]]) -> list[list[int]]:
        made = self.inner.draft(next_ids, picks, extra, tables)
        by_table = {id(q.block_ids): q for q in self.engine.scheduler.running}
        out = []
        for table, d in zip(tables, made):
            seq = by_table[id(table)]
            done = len(seq.output_token_ids)
            future = self.reference[key(seq)][done : done + len(d)]
            if self.bad_at is not None and len(future) > self.bad_at:
                future[self.bad_at:] = [forbidden(seq.grammar, future[: self.bad_at])] * (len(future) - self.bad_at)
            out.append(future)
        return out


def forbidden(grammar: Grammar | None, before: list[int]) -> int:
    """A token ``grammar`` does not allow after ``before`` (which it does)."""
    assert grammar is not None and grammar.matcher.validate_tokens(before) == len(before)
    return next(t for t in range(2, 1000) if grammar.matcher.validate_tokens(before + [t]) == len(before))


def verified(engine: LLMEngine) -> list[list[int]]:
    """Records the drafts each verify step was scheduled with (its rows: the last token and these)."""
    seen: list[list[int]] = []
    verify = engine._verify

    def recording(scheduled: list[Scheduled], logits: list[Any]) -> list[Sequence]:
        seen.extend(list(s.drafts) for s in scheduled if s.drafts)
        return verify(scheduled, logits)

    engine._verify = recording  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("bad_at", [None, 1, 0], ids=["all-right", "second-forbidden", "first-forbidden"])
def test_oracle_drafts_right_ones_all_accepted_forbidden_ones_never_verified(
        mtp_model: Path, reference: list[list[int]], bad_at: int | None) -> None:
    """k = 3. The known continuation: every draft is accepted. Its first token, then ones the grammar forbids:
    only that first one is scheduled and verified (and accepted). A forbidden first draft: nothing drafts.
    Outputs are the reference's each time; every block is freed."""
    with LLM(str(mtp_model), speculative_config=spec(3), **KW) as llm:
        engine = llm.engine
        assert engine.drafts is not None
        tok = engine.tokenizer
        assert tok is not None
        known = {tuple(tok.encode(p) if isinstance(p, str) else p): r for p, r in zip(PROMPTS, reference)}
        engine.drafts.executor = OracleDrafter(engine, known, bad_at)
        seen = verified(engine)
        outs = llm.generate(PROMPTS, params())
        assert [o.token_ids for o in outs] == reference
        c = engine.spec_counts
        assert c.accepted_tokens == c.draft_tokens == sum(map(len, seen))
        if bad_at is None:
            assert c.draft_tokens > c.steps and c.mean_accepted_length > 2.5
        elif bad_at == 1:
            assert c.steps > 0 and all(len(d) == 1 for d in seen)
        else:
            assert c.steps == 0 and not seen
        assert engine.num_used_blocks == 0


def test_seeded_sampled_grammar_requests_draft_and_stay_reproducible(mtp_model: Path) -> None:
    runs = []
    for _ in range(2):
        with LLM(str(mtp_model), speculative_config=spec(2), **KW) as llm:
            outs = llm.generate(PROMPTS, params(temperature=1.0, seed=3))
            assert llm.engine.spec_counts.draft_tokens > 0
            assert llm.engine.num_used_blocks == 0
        check([o.text for o in outs])
        runs.append([o.token_ids for o in outs])
    assert runs[0] == runs[1]


@pytest.fixture(scope="module")
def guidance(mtp_model: Path) -> GuidanceTokenizers:
    mc = ModelConfig.from_pretrained(str(mtp_model))
    return GuidanceTokenizers(Tokenizer(str(mtp_model)), mc.vocab_size, mc.eos_token_ids)


def test_each_verify_row_is_masked_as_decoding_would_mask_it(
        reference: list[list[int]], guidance: GuidanceTokenizers) -> None:
    """``mask_drafted``: each request's row i is masked as the sampler masks a decode row (``mask_logits``)
    after its first i drafts, taken one by one; other rows are left alone; the matchers end where they began.
    ``Grammar.draftable``: a forbidden draft ends the drafts, and so does one that completes the output."""
    tokens = reference[0]  # a JSON output, complete at its last token
    grammars = [Grammar(guidance.get(), CASES[0][1]) for _ in range(3)]
    for g in grammars:
        g.advance(tokens[0])
    drafts = [tokens[1:5], tokens[1:3], []]
    starts = [0, 5, 8]  # rows 0-4, 5-7, 8; row 9 belongs to no request
    logits = torch.randn(10, 1024, generator=torch.Generator().manual_seed(0))
    masked = mask_drafted(logits.clone(), starts, grammars, drafts)
    step = Grammar(guidance.get(), CASES[0][1])
    for i, t in enumerate(tokens[:5]):
        step.advance(t)  # now after the first i drafts
        for start, d in zip(starts, drafts):
            if i <= len(d):
                row = slice(start + i, start + i + 1)
                assert torch.equal(masked[row], mask_logits(logits[row].clone(), [step])), (start, i)
    assert torch.equal(masked[9], logits[9]) and not torch.equal(masked[8], logits[8])

    g = grammars[0]
    rest = tokens[1:]
    assert g.draftable(rest) == len(rest) and g.draftable(rest + [guidance.get().eos_token, 5]) == len(rest)
    assert g.draftable(rest[:2] + [forbidden(g, rest[:2])] + rest[3:]) == 2
    assert g.draftable([forbidden(g, [])] + rest) == 0
    assert g.matcher.validate_tokens(rest) == len(rest) and not g.done  # (the matcher did not move)


def test_a_biased_request_drafts_and_equals_decoding_without(mtp_model: Path) -> None:
    """``logit_bias`` does not depend on the tokens before a row: such a request drafts too, each verify row
    biased as a decode row is (the bias changes these outputs)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 1000, (n,), generator=g).tolist() for n in (3, 17, 40)]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(str(mtp_model), **KW) as llm:
        unbiased = [o.token_ids for o in llm.generate(prompts, plain)]
    bias = {t: 4.0 for out in unbiased for t in out[1::3]} | {t: -4.0 for out in unbiased for t in out[::5]}
    biased = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logit_bias=bias)
    with LLM(str(mtp_model), **KW) as llm:
        want = [o.token_ids for o in llm.generate(prompts, biased)]
    assert want != unbiased
    with LLM(str(mtp_model), speculative_config=spec(2), **KW) as llm:
        got = [o.token_ids for o in llm.generate(prompts, biased)]
        assert llm.engine.spec_counts.draft_tokens > 0 and llm.engine.num_used_blocks == 0
    assert got == want


def test_a_transferred_grammar_request_verifies_the_drafts_its_grammar_takes(
        mtp_model: Path, reference: list[list[int]]) -> None:
    """A prefill side with MTP holds each grammar request after its first token with a draft its grammar takes
    (or none); the decode side admits it with drafts: the known continuation (verified at its first step, all
    accepted) or a token its grammar forbids (dropped at admission: the first step decodes one token, and the
    request drafts after it). Outputs equal decoding in one engine; every block is freed."""
    with LLM(str(mtp_model), speculative_config=spec(2), **KW) as p_llm, \
            LLM(str(mtp_model), speculative_config=spec(2), **KW) as d_llm:
        p_eng, d_eng = p_llm.engine, d_llm.engine
        for i, (prompt, want, p) in enumerate(zip(PROMPTS, reference, params())):
            held = p_eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                            structured_outputs=p.structured_outputs),
                                     request_id=f"r{i}", hold_kv=True)
            while not held.is_finished:
                p_eng.step()
            assert held.finish_reason == "length" and held.output_token_ids == want[:1]
            assert held.grammar is not None and held.grammar.draftable(held.drafts) == len(held.drafts)
            seq = d_eng.begin_prefilled(held.prompt_token_ids, p, request_id=f"r{i}")
            for layer, cache in d_eng.cache_layers.items():
                cache[seq.block_ids] = p_eng.cache_layers[layer][held.block_ids]
            assert p_eng.release(f"r{i}") and seq.grammar is not None
            right = i % 2 == 1
            drafts = want[1:3] if right else [forbidden(seq.grammar, want[:1])]
            d_eng.admit_prefilled(seq, list(seq.block_ids), want[0], drafts=drafts)
            assert seq.drafts == (drafts if right else [])
            before = (d_eng.spec_counts.steps, d_eng.spec_counts.accepted_tokens)
            d_eng.step()
            assert (d_eng.spec_counts.steps, d_eng.spec_counts.accepted_tokens) == \
                ((before[0] + 1, before[1] + len(drafts)) if right else before)
            while d_eng.has_unfinished():
                d_eng.step()
            assert seq.output_token_ids == want
        assert p_eng.num_used_blocks == 0 and d_eng.num_used_blocks == 0
