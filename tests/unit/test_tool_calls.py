"""DeepSeek's tool-call format read back into OpenAI's tool_calls, whole and streamed in any pieces."""

from __future__ import annotations

import json
import random

from engine.structured_output import COMPACT_JSON
from proxy.api.tool_calls import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    ToolCall,
    ToolCallStream,
    constraint,
    forced_prefix,
    parse,
)

V3 = (f"Let me look.{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n"
      f'{{"city": "Paris", "unit": "C"}}\n```{CALL_END}{CALL_BEGIN}function{SEP}get_time\n```json\n{{}}\n```{CALL_END}'
      f"{CALLS_END}")
V31 = f'{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"city": "Oslo"}}{CALL_END}{CALLS_END}'
WANT = [ToolCall("get_weather", '{"city": "Paris", "unit": "C"}'), ToolCall("get_time", "{}")]


def test_whole_answers_in_both_formats() -> None:
    assert parse(V3) == ("Let me look.", WANT)
    assert parse(V31) == (None, [ToolCall("get_weather", '{"city": "Oslo"}')])
    assert parse("no calls here") == ("no calls here", [])
    assert json.loads(WANT[0].to_openai()["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    assert WANT[0].to_openai(index=1)["index"] == 1 and WANT[0].to_openai()["id"].startswith("call_")


def test_streamed_in_any_pieces_gives_the_same_content_and_calls() -> None:
    rng = random.Random(0)
    for text in (V3, V31, "plain text, with a < sign and a ｜ too", V3.replace(CALLS_END, "")):
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            stream, content, calls = ToolCallStream(), "", []
            for piece in pieces:
                c, k = stream.feed(piece)
                content, calls = content + c, calls + k
                assert CALLS_BEGIN[:2] not in c  # never a piece of the marker as content
            c, k = stream.finish()
            assert (content + c or None, calls + k) == parse(text)


def test_a_forced_start_and_an_answer_cut_inside_a_call() -> None:
    named = forced_prefix({"type": "function", "function": {"name": "get_weather"}})
    stream = ToolCallStream(named)
    assert stream.feed('{"city": "Rome"}\n```') == ("", [])
    assert stream.finish() == ("", [ToolCall("get_weather", '{"city": "Rome"}')])  # cut by max_tokens
    assert forced_prefix("required") == CALLS_BEGIN + CALL_BEGIN and forced_prefix("auto") == ""
    # "required" cut before the call's name: what was written comes back as text, never an empty answer
    stream = ToolCallStream(forced_prefix("required"))
    assert stream.feed("funct") == ("", []) and stream.finish() == ("funct", [])


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"], "additionalProperties": False}
TOOLS = [("get_weather", SCHEMA), ("get_time", None)]


def test_a_named_choice_holds_the_arguments_to_its_schema() -> None:
    c = constraint({"type": "function", "function": {"name": "get_weather"}}, TOOLS)
    assert c.json == SCHEMA
    assert constraint({"type": "function", "function": {"name": "get_time"}}, TOOLS).json == {"type": "object"}


def test_required_is_a_grammar_of_calls_of_the_tools_each_held_to_its_schema() -> None:
    grammar = constraint("required", TOOLS).grammar
    assert grammar is not None
    assert '"get_weather" "\\n```json\\n" a0' in grammar  # its arguments compact, as a named function's
    assert f"a0: %json {json.dumps({**SCHEMA, 'x-guidance': COMPACT_JSON})}" in grammar
    assert f'("{CALL_BEGIN}" call)*' in grammar  # several calls ...
    assert f'("{CALL_BEGIN}" call)*' not in constraint("required", TOOLS, parallel=False).grammar  # ... or one
    by_id = constraint("required", TOOLS, marker=lambda m: f"<[{MARKER_IDS[m]}]>").grammar
    assert f"<[{MARKER_IDS[CALLS_END]}]>" in by_id and CALLS_END not in by_id  # special tokens by their ids


MARKER_IDS = {CALLS_BEGIN: 1, CALLS_END: 2, CALL_BEGIN: 3, CALL_END: 4, SEP: 5}
