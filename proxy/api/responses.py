"""OpenAI's response shapes: whole responses, SSE chunks and logprobs, for both endpoints.

``CompletionFormat`` ("text_completion") and ``ChatFormat`` ("chat.completion" /
"chat.completion.chunk") share one interface, so the serving code streams either the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import orjson

from cluster.proto_gen import pdcluster_v1_pb2 as pb
from proxy.api.tool_calls import ToolCall, ToolCallStream

# JSON has no -inf: a token the sampler could not have picked gets this instead (as vLLM does).
MIN_LOGPROB = -9999.0
_MARK = "\x00pdcluster delta text\x00"  # stands for the text in a plain delta's event (_Base.delta_event)


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event, as the bytes sent (orjson: compact UTF-8; a non-finite float is null)."""
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    return b"data: " + payload + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _logprob(x: float) -> float:
    return MIN_LOGPROB if math.isnan(x) or x < MIN_LOGPROB else float(x)


def _as_token_id(token_id: int) -> str:
    return f"token_id:{token_id}"


class TokenTexts:
    """Token id -> its text as logprobs show it (special tokens spelled out), cached per id."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._tok = tokenizer
        self._shown: dict[int, str] = {}
        self._visible: dict[int, int] = {}

    def shown(self, token_id: int) -> str:
        s = self._shown.get(token_id)
        if s is None:
            s = self._shown[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return s

    def visible_len(self, token_id: int) -> int:
        """How many characters the token adds to the output text (special tokens: none)."""
        n = self._visible.get(token_id)
        if n is None:
            n = self._visible[token_id] = len(self._tok.decode([token_id], skip_special_tokens=True))
        return n


class Format(Protocol):
    """The JSON shapes of one endpoint for one request."""

    def response(self, text: str, finish_reason: str, tokens: Sequence[pb.Token],
                 usage: dict[str, int]) -> dict[str, Any]:
        ...

    def first_chunks(self) -> list[dict[str, Any]]: ...

    def echo(self, prompt_text: str, prompt_tokens: Sequence[pb.Token]) -> None: ...

    def delta_chunk(self, text: str, tokens: Sequence[pb.Token]) -> dict[str, Any]: ...

    def delta_event(self, text: str, tokens: Sequence[pb.Token]) -> bytes: ...

    def final_chunks(self, text: str, tokens: Sequence[pb.Token], finish_reason: str) -> list[dict[str, Any]]: ...

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]: ...


class _Base:
    object: str = ""
    chunk_object: str = ""

    def __init__(self, request_id: str, created: int, model: str, *, logprobs: bool, include_usage: bool,
                 texts: TokenTexts, token_ids: bool = False, index: int = 0) -> None:
        """``token_ids``: logprobs name each token "token_id:<id>" (vLLM's ``return_tokens_as_token_ids``);
        ``index``: the choice's index (several with ``n`` > 1 or several prompts)."""
        self.index = index
        self.request_id = request_id
        self.created = created
        self.model = model
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.texts = texts
        self.shown: Callable[[int], str] = _as_token_id if token_ids else texts.shown

    _frame: tuple[bytes, bytes] | None = None  # a plain delta's event, before and after its text

    def delta_chunk(self, text: str, tokens: Sequence[pb.Token]) -> dict[str, Any]:
        raise NotImplementedError

    def _plain(self) -> bool:
        """Whether a delta is its text alone (no logprobs, no tool calls): the same event around it."""
        return not self.logprobs

    def delta_event(self, text: str, tokens: Sequence[pb.Token]) -> bytes:
        """``sse(self.delta_chunk(text, tokens))``. A plain delta's event is made once per request with
        a mark for its text, and then is that event's bytes around each text's JSON string: 0.3 against
        1.9 us an event (a dict and its encoding each time), ~10 events a request (docs/benchmarks.md)."""
        if not self._plain():
            return sse(self.delta_chunk(text, tokens))
        if self._frame is None:
            head, mark, tail = sse(self.delta_chunk(_MARK, ())).partition(orjson.dumps(_MARK))
            assert mark, "the mark is in the event"
            self._frame = (head, tail)
        return self._frame[0] + orjson.dumps(text) + self._frame[1]

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope(self.chunk_object, [choice])
        if self.include_usage:
            out["usage"] = None  # OpenAI: null on every chunk but the usage chunk
        return out

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object, []), "usage": usage}


class CompletionFormat(_Base):
    """``/v1/completions``; logprobs as tokens / token_logprobs / top_logprobs / text_offset."""

    object = chunk_object = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._offset = 0  # text_offset of the next token, across chunks
        self._echo: tuple[str, list[pb.Token]] | None = None

    def echo(self, prompt_text: str, prompt_tokens: Sequence[pb.Token]) -> None:
        """``echo``: the answer starts with the prompt's text (and, with logprobs, its tokens: the
        first has no logprob)."""
        self._echo = (prompt_text, list(prompt_tokens))

    def _logprobs(self, tokens: Sequence[pb.Token], prompt: bool = False) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, t in enumerate(tokens):
            first = prompt and i == 0  # OpenAI: the first prompt token has no logprob
            out["tokens"].append(self.shown(t.token_id))
            out["token_logprobs"].append(None if first else _logprob(t.logprob))
            out["top_logprobs"].append(None if first else {self.shown(x.token_id): _logprob(x.logprob) for x in t.top})
            out["text_offset"].append(self._offset)
            self._offset += self.texts.visible_len(t.token_id)
        return out

    def _choice(self, text: str, tokens: Sequence[pb.Token], finish_reason: str | None) -> dict[str, Any]:
        return {"index": self.index, "text": text, "logprobs": self._logprobs(tokens), "finish_reason": finish_reason}

    def _echoed(self) -> dict[str, Any] | None:
        """The prompt's choice part (its text, its tokens' logprobs), once."""
        if self._echo is None:
            return None
        text, tokens = self._echo
        self._echo = None
        return {"index": self.index, "text": text, "logprobs": self._logprobs(tokens, prompt=True),
                "finish_reason": None}

    def response(self, text: str, finish_reason: str, tokens: Sequence[pb.Token],
                 usage: dict[str, int]) -> dict[str, Any]:
        echoed = self._echoed()
        choice = self._choice(text, tokens, finish_reason)
        if echoed is not None:
            choice["text"] = echoed["text"] + text
            if echoed["logprobs"] is not None and choice["logprobs"] is not None:
                choice["logprobs"] = {k: echoed["logprobs"][k] + v for k, v in choice["logprobs"].items()}
        return {**self._envelope(self.object, [choice]), "usage": usage}

    def first_chunks(self) -> list[dict[str, Any]]:
        echoed = self._echoed()
        return [] if echoed is None else [self._chunk(echoed)]

    def delta_chunk(self, text: str, tokens: Sequence[pb.Token]) -> dict[str, Any]:
        return self._chunk(self._choice(text, tokens, None))

    def final_chunks(self, text: str, tokens: Sequence[pb.Token], finish_reason: str) -> list[dict[str, Any]]:
        return [self._chunk(self._choice(text, tokens, finish_reason))]


class ChatFormat(_Base):
    """``/v1/chat/completions``; logprobs as content: [{token, logprob, bytes, top_logprobs}]."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def echo(self, prompt_text: str, prompt_tokens: Sequence[pb.Token]) -> None:
        raise ValueError("echo is a completions option")

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        s = self.shown(token_id)
        return {"token": s, "logprob": _logprob(logprob), "bytes": list(s.encode("utf-8"))}

    def _logprobs(self, tokens: Sequence[pb.Token]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"content": [
            {**self._entry(t.token_id, t.logprob), "top_logprobs": [self._entry(x.token_id, x.logprob) for x in t.top]}
            for t in tokens
        ]}

    _tools: ToolCallStream | None = None
    _calls = 0  # tool calls sent so far

    def _plain(self) -> bool:
        return not self.logprobs and self._tools is None

    def offer_tools(self, stream: ToolCallStream) -> None:
        """Read DeepSeek's tool calls out of the answer (``proxy.api.tool_calls``) into ``tool_calls``."""
        self._tools = stream

    def response(self, text: str, finish_reason: str, tokens: Sequence[pb.Token],
                 usage: dict[str, int]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self._tools is not None:
            content, calls = self._tools.feed(text)
            rest, last = self._tools.finish()
            message["content"] = (content + rest) or None
            if calls or last:
                message["tool_calls"] = [c.to_openai() for c in calls + last]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        choice = {"index": self.index, "message": message, "logprobs": self._logprobs(tokens),
                  "finish_reason": finish_reason}
        return {**self._envelope(self.object, [choice]), "usage": usage}

    def _delta(self, delta: dict[str, Any], tokens: Sequence[pb.Token], finish_reason: str | None) -> dict[str, Any]:
        logprobs = self._logprobs(tokens) if tokens else None
        return self._chunk({"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})

    def first_chunks(self) -> list[dict[str, Any]]:
        return [self._delta({"role": "assistant", "content": ""}, (), None)]

    def delta_chunk(self, text: str, tokens: Sequence[pb.Token]) -> dict[str, Any]:
        if self._tools is None:
            return self._delta({"content": text}, tokens, None)
        content, calls = self._tools.feed(text)
        return self._delta(self._tool_delta(content, calls), tokens, None)

    def _tool_delta(self, content: str, calls: list[ToolCall]) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [c.to_openai(index=self._calls + k) for k, c in enumerate(calls)]
            self._calls += len(calls)
        return delta

    def final_chunks(self, text: str, tokens: Sequence[pb.Token], finish_reason: str) -> list[dict[str, Any]]:
        # OpenAI sends the finish reason in a chunk of its own, with an empty delta.
        if self._tools is not None:
            content, calls = self._tools.feed(text)
            rest, last = self._tools.finish()
            delta = self._tool_delta(content + rest, calls + last)
            out = [self._delta(delta, tokens, None)] if delta or (tokens and self.logprobs) else []
            if self._calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            return out + [self._delta({}, (), finish_reason)]
        out = [self.delta_chunk(text, tokens)] if text or (tokens and self.logprobs) else []
        return out + [self._delta({}, (), finish_reason)]
