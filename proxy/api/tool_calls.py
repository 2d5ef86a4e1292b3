"""DeepSeek's tool-call format, read back into OpenAI's ``tool_calls``.

A DeepSeek model calls tools by writing, after any text of its own::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"arg": ...}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

(V2/V3; V3.1 writes ``NAME<｜tool▁sep｜>ARGUMENTS`` between the call markers: both are read). ``parse``
reads a whole answer; ``ToolCallStream`` reads one as it streams: text before the calls goes out
as content (holding back a tail that could start the marker), each call as soon as its end marker
arrives. ``forced_prefix`` is what ``tool_choice`` "required" or a named function puts at the start
of the answer (appended to the prompt): the model then continues inside a call, and ``constraint`` holds
it to the tools' schemas as vLLM does (a named function: its parameters' JSON schema; "required": one or
more calls of the tools, each with arguments its schema allows, then the end marker), so the arguments
always parse and hold the required keys. Arguments are passed on as the model wrote them (OpenAI's
``arguments`` is a string; clients parse it).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.structured_output import COMPACT_JSON, StructuredOutputsParams

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
FENCE_OPEN, FENCE_CLOSE = "\n```json\n", "\n```"  # around a V2/V3 call's arguments


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's shape (with ``index``: a streamed delta's)."""
        out: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def forced_prefix(choice: str | dict[str, Any]) -> str:
    """The start of an answer that must call a tool: any ("required"), or the named one."""
    if isinstance(choice, dict):
        return f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}{choice['function']['name']}{FENCE_OPEN}"
    return f"{CALLS_BEGIN}{CALL_BEGIN}" if choice == "required" else ""


def constraint(choice: str | dict[str, Any], tools: list[tuple[str, dict[str, Any] | None]],
               marker: Callable[[str], str] | None = None, parallel: bool = True) -> StructuredOutputsParams:
    """What may follow ``forced_prefix(choice)``: for a named function its arguments as its parameters' schema
    allows (the answer ends with the JSON); for "required" a Lark grammar of calls of ``tools`` ((name, its
    parameters' schema) each), one or, with ``parallel``, more, then the end marker. ``marker(text)`` writes
    a marker as the grammar names it (a special token by id, ``<[id]>``; default: as text)."""
    params = {name: schema if schema else {"type": "object"} for name, schema in tools}
    marker = marker or lark_literal
    if isinstance(choice, dict):
        return StructuredOutputsParams(json=params[choice["function"]["name"]])
    lit = lark_literal
    rules = []
    for i, (name, schema) in enumerate(params.items()):
        compact = {**schema, "x-guidance": COMPACT_JSON}  # as a named function's arguments are written
        rules += [f"t{i}: {lit(name)} {lit(FENCE_OPEN)} a{i}", f"a{i}: %json {json.dumps(compact)}"]
    names = " | ".join(f"t{i}" for i in range(len(params)))
    call = f"call: {lit('function')} {marker(SEP)} ({names}) {lit(FENCE_CLOSE)} {marker(CALL_END)}"
    more = f" ({marker(CALL_BEGIN)} call)*" if parallel else ""
    return StructuredOutputsParams(grammar="\n".join([f"start: call{more} {marker(CALLS_END)}", call, *rules]))


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def parse_call(body: str) -> ToolCall | None:
    """One call's text between its markers (None when it has no separator)."""
    if SEP not in body:
        return None
    head, rest = body.split(SEP, 1)
    if head.strip() == "function":  # V2/V3: the name on the separator's line, then a json block
        name, _, args = rest.partition("\n")
    else:  # V3.1: the name before the separator, the arguments after
        name, args = head, rest
    args = args.strip()
    if args.startswith("```"):
        args = args.split("\n", 1)[1] if "\n" in args else ""
        args = args.rsplit("```", 1)[0].strip()
    return ToolCall(name.strip(), args)


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer: (its content, None when empty; its tool calls), as ``ToolCallStream`` reads it."""
    stream = ToolCallStream()
    content, calls = stream.feed(text)
    rest, last = stream.finish()
    return content + rest or None, calls + last


class ToolCallStream:
    """An answer as it streams: ``feed`` each text delta, ``finish`` at the end; each returns the
    content to send and the calls completed since."""

    def __init__(self, prefix: str = "") -> None:
        self._buf = ""
        self._in_calls = False
        if prefix:
            self.feed(prefix)  # forced: never sent as content

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content = ""
        if not self._in_calls:
            i = self._buf.find(CALLS_BEGIN)
            if i < 0:
                keep = _partial_marker(self._buf)
                content, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return content, []
            content, self._buf = self._buf[:i], self._buf[i + len(CALLS_BEGIN):]
            self._in_calls = True
        calls = []
        while CALL_END in self._buf:
            part, self._buf = self._buf.split(CALL_END, 1)
            call = parse_call(part.split(CALL_BEGIN, 1)[-1])
            if call is not None:
                calls.append(call)
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest: held-back text, or a last call the answer ended inside (length)."""
        rest, self._buf = self._buf, ""
        if not self._in_calls:
            return rest, []
        part = rest.split(CALLS_END, 1)[0].split(CALL_BEGIN, 1)[-1]
        call = parse_call(part) if part.strip() else None
        if call is None and part.strip():  # cut (length) before a call had its name: what was written, as text
            return part, []
        return "", [call] if call is not None else []


def _partial_marker(text: str) -> int:
    """How many trailing characters of ``text`` could start the calls marker."""
    for n in range(min(len(text), len(CALLS_BEGIN) - 1), 0, -1):
        if CALLS_BEGIN.startswith(text[-n:]):
            return n
    return 0
