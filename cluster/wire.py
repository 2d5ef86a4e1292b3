"""Conversions between the wire messages (``pdcluster.v1``) and the engine's types."""

from __future__ import annotations

import json
import math

from cluster.proto_gen import pdcluster_v1_pb2 as pb
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams


def sampling_from_pb(m: pb.SamplingParams, max_tokens: int | None = None) -> SamplingParams:
    """The engine's SamplingParams; raises ValueError for values it refuses (-> INVALID_ARGUMENT)."""
    return SamplingParams(
        temperature=float(m.temperature),
        top_p=float(m.top_p) if m.top_p else 1.0,
        top_k=int(m.top_k),
        seed=int(m.seed) if m.HasField("seed") else None,
        max_tokens=int(m.max_tokens) if max_tokens is None else max_tokens,
        min_tokens=int(m.min_tokens),
        stop=list(m.stop) or None,
        stop_token_ids=list(m.stop_token_ids) or None,
        ignore_eos=bool(m.ignore_eos),
        logprobs=int(m.logprobs) if m.HasField("logprobs") else None,
        presence_penalty=float(m.presence_penalty),
        frequency_penalty=float(m.frequency_penalty),
        repetition_penalty=float(m.repetition_penalty) if m.repetition_penalty else 1.0,
        min_p=float(m.min_p),
        logit_bias={int(t): float(b) for t, b in m.logit_bias.items()} or None,
        prompt_logprobs=int(m.prompt_logprobs) if m.HasField("prompt_logprobs") else None,
        structured_outputs=structured_from_pb(m.structured_output) if m.HasField("structured_output") else None,
    )


def structured_from_pb(m: pb.StructuredOutput) -> StructuredOutputsParams:
    """The engine's constraint; ValueError when it names none or does not compile."""
    kind = m.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_output names no constraint")
    if kind == "choice":
        return StructuredOutputsParams(choice=list(m.choice.items), any_whitespace=m.any_whitespace)
    arg = {"json_schema": "json"}.get(kind, kind)
    return StructuredOutputsParams(**{arg: getattr(m, kind)}, any_whitespace=m.any_whitespace)


def structured_to_pb(s: StructuredOutputsParams) -> pb.StructuredOutput:
    m = pb.StructuredOutput(any_whitespace=s.any_whitespace)
    if s.json_object:
        m.json_object = True
    elif s.json is not None:
        m.json_schema = s.json if isinstance(s.json, str) else json.dumps(s.json)
    elif s.choice is not None:
        m.choice.items.extend(s.choice)
    elif s.regex is not None:
        m.regex = s.regex
    else:
        m.grammar = s.grammar or ""
    return m


def sampling_to_pb(p: SamplingParams) -> pb.SamplingParams:
    m = pb.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=max(p.top_k, 0), max_tokens=p.max_tokens or 0,
        min_tokens=p.min_tokens, stop=p.stop_strings, stop_token_ids=p.stop_token_ids or [], ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, min_p=p.min_p, logit_bias=p.logit_bias or {},
    )
    if p.seed is not None:
        m.seed = p.seed
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        m.prompt_logprobs = p.prompt_logprobs
    if p.structured_outputs is not None:
        m.structured_output.CopyFrom(structured_to_pb(p.structured_outputs))
    return m


def token_pb(token_id: int, logprob: float | None = None, top: dict[int, float] | None = None) -> pb.Token:
    lp = math.nan if logprob is None else float(logprob)
    return pb.Token(token_id=token_id, logprob=lp,
                    top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in (top or {}).items()])


def top_from_pb(t: pb.Token) -> dict[int, float] | None:
    """A token's top logprobs as the engine takes them (None when it carries none)."""
    return {x.token_id: x.logprob for x in t.top} or None
