"""Structured output in the engine: every output of a schema corpus parses and validates, with the tiny
random-weight model, greedy and sampled; regexes, choices and grammars hold; bad constraints are refused."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from cluster.wire import sampling_from_pb, sampling_to_pb
from engine import LLM, SamplingParams
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.structured_output import StructuredOutputsParams
from engine.tokenizer import Tokenizer

# Schemas whose every output is bounded (strings with maxLength, numbers with bounds and multipleOf,
# arrays with maxItems): a random model then ends each one well within max_tokens. An unbounded
# number or string can run to max_tokens (finish_reason "length"), as it can with vLLM or OpenAI.
CORPUS = {
    "nested_objects": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                      "id": {"type": "integer", "minimum": 0, "maximum": 1000}},
                     "required": ["name", "id"], "additionalProperties": False},
            "meta": {"type": "object", "properties": {"active": {"type": "boolean"}, "note": {"type": "null"}},
                     "required": ["active", "note"], "additionalProperties": False},
        },
        "required": ["user", "meta"], "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]},
                       "kind": {"const": "shirt"}},
        "required": ["color", "size", "kind"], "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.5},
                       "ratio": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25},
                       "count": {"type": "integer", "minimum": -50, "maximum": 50000}},
        "required": ["price", "ratio", "count"], "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "string", "maxLength": 8},
                                           {"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]}},
        "required": ["value"], "additionalProperties": False,
    },
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 6},
}

PROMPTS: list[str | list[int]] = ["Give me JSON:", "hello world", "the cat sat on the mat", [5, 9, 300, 7]]


@pytest.fixture(scope="module")
def llm(tiny_model: Path):
    with LLM(str(tiny_model), dtype="float32", device="cpu") as llm:
        yield llm


def constrained(spec: StructuredOutputsParams, temperature: float = 0.0, seed: int | None = None,
                **kw: object) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=kw.pop("max_tokens", 256),  # type: ignore[arg-type]
                          structured_outputs=spec, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(CORPUS))
def test_every_output_of_the_schema_corpus_parses_and_validates(llm: LLM, name: str) -> None:
    schema = CORPUS[name]
    spec = StructuredOutputsParams(json=schema)
    params = [constrained(spec)] * len(PROMPTS) + [constrained(spec, 1.0, seed) for seed in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS + PROMPTS, params)
    for out in outs:
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert len({o.text for o in outs}) > 1  # the model's choices still matter inside the grammar


def test_schema_as_text_any_whitespace_and_json_object(llm: LLM) -> None:
    schema = CORPUS["enums"]
    compact, = llm.generate(["x"], constrained(StructuredOutputsParams(json=json.dumps(schema))))
    assert json.loads(compact.text) and ", " in compact.text and ": " in compact.text
    loose, = llm.generate(["x"], constrained(StructuredOutputsParams(json=schema, any_whitespace=True)))
    assert loose.finish_reason in ("stop", "length")
    if loose.finish_reason == "stop":
        jsonschema.validate(json.loads(loose.text), schema)
    outs = llm.generate(PROMPTS, constrained(StructuredOutputsParams(json_object=True)))
    # any object: its keys are unbounded strings, so a random model may run to max_tokens in one
    assert all(o.finish_reason == "length" or isinstance(json.loads(o.text), dict) for o in outs)
    assert any(o.finish_reason == "stop" for o in outs) and all(o.text.startswith("{") for o in outs)


def test_regex_choice_and_lark_grammar_hold(llm: LLM) -> None:
    regex = r"[0-9]{3}-[0-9]{4}"
    choices = ["yes", "no", "maybe so"]
    lark = 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        for out in llm.generate(PROMPTS, constrained(StructuredOutputsParams(regex=regex), temperature, seed)):
            assert re.fullmatch(regex, out.text), out.text
        for out in llm.generate(PROMPTS, constrained(StructuredOutputsParams(choice=choices), temperature, seed)):
            assert out.text in choices
        for out in llm.generate(PROMPTS, constrained(StructuredOutputsParams(grammar=lark), temperature, seed,
                                                     max_tokens=400)):
            assert out.finish_reason in ("stop", "length")
            if out.finish_reason == "stop":
                assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", out.text), out.text


def test_the_mask_beats_a_bias_and_min_tokens_yields_to_a_finished_grammar(llm: LLM) -> None:
    """A +100 logit bias on a token the grammar forbids cannot bring it in; min_tokens cannot hold a
    finished choice open."""
    tok = Tokenizer(llm.engine.config.model)
    banned = tok.encode("zzz", add_special_tokens=False)[0]
    out, = llm.generate(["x"], constrained(StructuredOutputsParams(choice=["yes", "no"]), logit_bias={banned: 100.0},
                                           min_tokens=8))
    assert out.text in ("yes", "no") and banned not in out.token_ids and out.finish_reason == "stop"


def test_an_unbounded_schema_can_end_by_length_like_any_output(llm: LLM) -> None:
    out, = llm.generate(["x"], constrained(StructuredOutputsParams(json={"type": "string"}), max_tokens=3))
    assert out.finish_reason == "length" and out.text.startswith('"') and len(out.token_ids) == 3


def test_a_prefilled_first_token_the_grammar_forbids_is_refused_before_admission(tiny_model: Path) -> None:
    """The decode side replays the prefill node's first token into its matcher (the outputs equal a
    colocated run: tests/e2e/test_cluster.py); one the grammar forbids is refused, not decoded on."""
    tok = Tokenizer(tiny_model)
    decode = LLMEngine(EngineConfig(model=str(tiny_model), dtype="float32", device="cpu"))
    seq = decode.begin_prefilled(tok.encode("colors:"), constrained(StructuredOutputsParams(json=CORPUS["enums"])))
    with pytest.raises(ValueError, match="not allowed by the request's structured output"):
        decode.admit_prefilled(seq, list(seq.block_ids), tok.encode("x", False)[0])
    decode.abort(seq.request_id)
    assert decode.num_used_blocks == 0


def test_bad_constraints_are_refused_before_any_work() -> None:
    for kw, match in [
        ({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"json": {"type": "objectx"}}, "does not compile"), ({"json": "{not json"}, "not JSON"),
        ({"json": 5}, "JSON schema"), ({"regex": "(a"}, "does not compile"), ({"choice": "abc"}, "list"),
        ({"choice": []}, "1 to"), ({"choice": ["a", ""]}, "non-empty"), ({"grammar": "start: foo"}, "compile"),
    ]:
        with pytest.raises(ValueError, match=match):
            StructuredOutputsParams(**kw)  # type: ignore[arg-type]


def test_the_constraint_crosses_the_wire_unchanged() -> None:
    for spec in [StructuredOutputsParams(json=CORPUS["enums"]), StructuredOutputsParams(json_object=True),
                 StructuredOutputsParams(regex="a+", any_whitespace=True), StructuredOutputsParams(choice=["a", "b c"]),
                 StructuredOutputsParams(grammar='start: "x"')]:
        back = sampling_from_pb(sampling_to_pb(SamplingParams(structured_outputs=spec))).structured_outputs
        assert back is not None and back.lark == spec.lark and back.any_whitespace == spec.any_whitespace
    assert sampling_from_pb(sampling_to_pb(SamplingParams())).structured_outputs is None


def test_the_proxy_checks_constraints_without_importing_torch() -> None:
    """The proxy compiles constraints to refuse bad ones; that must not pull torch into it (startup, RSS)."""
    code = ("import sys; from proxy.app import create_app; from proxy.api.protocol import CompletionRequest; "
            "CompletionRequest(prompt='x', guided_json={'type': 'object'}).sampling(4); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def check_bitmask(rows: int, vocab: int, words: int, device: str = "cpu", dtype: str = "float32") -> None:
    """``apply_bitmask`` against llguidance's own numpy kernel (same layout: bit t % 32 of word t // 32) on a random
    host mask (pinned for a GPU) and ``dtype`` logits on ``device`` with one -inf among them."""
    import llguidance.numpy as ln
    import numpy as np
    import torch

    from engine.structured_output import apply_bitmask

    gen = torch.Generator().manual_seed(rows * vocab)
    mask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    mask = mask.pin_memory() if device != "cpu" else mask
    logits = torch.randn(rows, vocab, generator=gen).to(getattr(torch, dtype))
    logits[0, 5] = float("-inf")
    want = logits.float().numpy().copy()
    ln.apply_token_bitmask_inplace(want, mask.numpy())
    got = apply_bitmask(logits.to(device), mask)
    assert got.dtype == logits.dtype and np.array_equal(got.float().cpu().numpy(), want)
    assert 0 < int(torch.isinf(got).sum()) < got.numel()


@pytest.mark.parametrize("rows,vocab,words", [(1, 1000, 32), (3, 102400, 3200), (2, 77, 3), (2, 100, 2)])
def test_the_bitmask_forbids_exactly_the_clear_bits(rows: int, vocab: int, words: int) -> None:
    """A vocabulary that is not whole words, a mask shorter than the vocabulary (tests/gpu: on a device)."""
    check_bitmask(rows, vocab, words)


def test_a_structured_request_compiles_nothing(tiny_model: Path) -> None:
    """Masking needs no torch.compile: llguidance.torch's kernel imported torch._dynamo and compiled in every
    process at its first structured request (seconds; a C++ compiler on CPU nodes)."""
    code = (f"import sys; from engine import LLM, SamplingParams; "
            f"from engine.structured_output import StructuredOutputsParams as S\n"
            f"with LLM({str(tiny_model)!r}, dtype='float32', device='cpu') as llm:\n"
            f"    out = llm.generate([[5, 9], [7]], [\n"
            f"        SamplingParams(max_tokens=8, structured_outputs=S(choice=['yes', 'no'])),\n"
            f"        SamplingParams(max_tokens=8, structured_outputs=S(regex='[0-9]+'))])\n"
            f"assert out[0].text in ('yes', 'no') and out[1].text.isdigit(), [o.text for o in out]\n"
            f"assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
