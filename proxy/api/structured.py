"""The ways an OpenAI request asks for structured output, read into the engine's one constraint.

- OpenAI's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
- vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
  ``disable_any_whitespace``) and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
  ``guided_grammar`` fields.

At most one of them may constrain a request. The constraint is compiled here (llguidance, ~1 ms), so a
schema that does not compile is a 400 before any node is involved.
"""

from __future__ import annotations

from typing import Any

from engine.structured_output import StructuredOutputsParams

_VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def from_response_format(fmt: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError('response_format of type "json_schema" needs a json_schema object')
        schema = spec.get("schema", {})  # OpenAI's: a missing schema allows any JSON
        if not isinstance(schema, (dict, bool)):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        if schema is False:
            raise ValueError("response_format.json_schema.schema is false: no output could match it")
        return StructuredOutputsParams(json=schema if isinstance(schema, dict) else {})
    raise ValueError(f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}')


def from_vllm(so: dict[str, Any]) -> StructuredOutputsParams:
    """vLLM's ``structured_outputs`` object; unknown keys are refused (a silently ignored constraint would
    be worse than a 400)."""
    known = set(_VLLM_KEYS) | {"disable_any_whitespace", "whitespace_pattern", "backend",
                               "disable_fallback", "disable_additional_properties"}
    unknown = sorted(set(so) - known)
    if unknown:
        raise ValueError(f"structured_outputs: unsupported field(s) {', '.join(unknown)}")
    args = {k: so[k] for k in _VLLM_KEYS if so.get(k) not in (None, False)}
    return StructuredOutputsParams(**args, any_whitespace=not so.get("disable_any_whitespace", True))


def resolve(response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None,
            guided: dict[str, Any]) -> StructuredOutputsParams | None:
    """The request's one constraint (or None); ValueError when several are given or one does not compile."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if response_format:
        params = from_response_format(response_format)
        if params is not None:
            found.append(("response_format", params))
    if structured_outputs:
        found.append(("structured_outputs", from_vllm(structured_outputs)))
    given = {k: v for k, v in guided.items() if v is not None}
    if given:
        if len(given) > 1:
            raise ValueError(f"give one of {', '.join('guided_' + k for k in sorted(given))}")
        ((key, value),) = given.items()
        found.append((f"guided_{key}", StructuredOutputsParams(**{key: value})))
    if len(found) > 1:
        raise ValueError(f"give one structured output constraint, got {' and '.join(n for n, _ in found)}")
    return found[0][1] if found else None
