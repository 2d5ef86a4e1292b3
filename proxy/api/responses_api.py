"""OpenAI's Responses API (``POST /v1/responses``) on top of chat completions.

A Responses request is read (``ResponsesRequest``) and turned into the chat completion it asks for
(``chat_body``): ``instructions`` as the system message, ``input`` (text, or message / function_call /
function_call_output items) as the messages, function ``tools`` and ``tool_choice`` in chat's shape,
``text.format`` as ``response_format``, ``max_output_tokens`` as ``max_tokens``, and vLLM's sampling
extensions to the Responses request (``top_k``, ``stop``, ``ignore_eos``, the penalties, ``logit_bias``)
under their own names (benchmark clients such as guidellm and aiperf send ``ignore_eos`` here, as on chat,
to fix the output length). That chat request runs as any other (validation, routing, structured output and
forced tool calls included), and its answer is turned back: a whole one into a ``response`` object
(``ResponseView.from_chat``), a stream's chunks into the Responses events, in OpenAI's order
(``ResponseView.events``: ``response.created``, ``response.in_progress``, per output item
``response.output_item.added``, then a message's ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``, ``response.content_part.done``, or a
function call's ``response.function_call_arguments.done``, then ``response.output_item.done``; last
``response.completed``, whose response's status is "incomplete" when ``max_output_tokens`` cut it, as vLLM
sends it).

As vLLM does by default, nothing is stored: ``store`` is accepted and answered false, and
``previous_response_id`` (which needs a stored response) is a 400.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from proxy.api.sse import DONE

# The request's fields that go to the chat request as they are, or renamed.
_CHAT_FIELDS = ("max_output_tokens", "temperature", "top_p", "seed", "parallel_tool_calls", "user", "top_k",
                "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "stop", "ignore_eos")
_RENAMED = {"max_output_tokens": "max_tokens"}


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: the fields we read; others are ignored, as chat's are."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    # vLLM's extensions (its ResponsesRequest has them); the chat request checks their values.
    top_k: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request this asks for; ValueError (a 400) for what it cannot be."""
        if self.previous_response_id is not None:
            raise ValueError("this server does not store responses, so previous_response_id cannot be resolved: "
                             "send the conversation so far as input items")
        if self.background:
            raise ValueError("background responses are not supported")
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for field in _CHAT_FIELDS:
            if getattr(self, field) is not None:
                body[_RENAMED.get(field, field)] = getattr(self, field)
        if self.tools:
            body["tools"] = [_chat_tool(t) for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = _response_format(fmt)
        return body

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                messages.append({"role": item.get("role"), "content": _text(item.get("content"), i)})
            elif kind == "function_call":
                _require_text(item, i, "call_id", "name", "arguments")
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                    last["tool_calls"].append(call)  # one assistant turn, several calls
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                _require_text(item, i, "call_id")
                if "output" not in item:
                    raise ValueError(f"input[{i}]: a function_call_output item needs its output")
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": output if isinstance(output, str) else orjson.dumps(output).decode()})
            else:
                raise ValueError(f"input[{i}]: items of type {kind!r} are not supported (message, function_call and "
                                 "function_call_output are)")
        return messages


def _require_text(item: dict[str, Any], i: int, *fields: str) -> None:
    """A function call item's fields that OpenAI requires, each a string."""
    for name in fields:
        if not isinstance(item.get(name), str):
            raise ValueError(f"input[{i}]: a {item['type']} item needs {name} (a string)")


def _text(content: Any, i: int) -> str:
    """A message item's content: text, or its text parts (input_text / output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"input[{i}].content must be text or a list of text parts")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"input[{i}].content: parts of type {kind!r} are not supported (text parts are)")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":  # (the chat request checks the rest: name, parameters)
        raise ValueError(f"tools: only function tools are supported, got {tool.get('type')!r}")
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}')
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict):
        raise ValueError("text.format must be an object")
    kind = fmt.get("type")
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise ValueError(f'text.format type must be "text", "json_object" or "json_schema", got {kind!r}')


class ResponseView:
    """One response's shape: its id, what it echoes of the request, and the chat answer turned into it."""

    def __init__(self, req: ResponsesRequest, created_at: int, model: str) -> None:
        self.req = req
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = created_at
        self.model = model
        self._seq = 0

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        r = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": None, "store": False, "temperature": r.temperature,
            "text": {"format": (r.text or {}).get("format") or {"type": "text"}},
            "tool_choice": r.tool_choice or "auto", "tools": r.tools or [], "top_p": r.top_p, "truncation": "disabled",
            "usage": _usage(usage), "user": r.user, "metadata": r.metadata or {},
        }

    def from_chat(self, completion: dict[str, Any]) -> dict[str, Any]:
        """A whole chat completion as the response object."""
        choice = completion["choices"][0]
        message = choice["message"]
        output = []
        if message.get("content"):
            output.append(_message_item(f"msg_{uuid.uuid4().hex}", message["content"], "completed"))
        output += [_call_item(c, "completed") for c in message.get("tool_calls") or []]
        return self.response(_status(choice["finish_reason"]), output, completion.get("usage"))

    async def events(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A chat completion's SSE chunks as the Responses events."""
        output: list[dict[str, Any]] = []
        message: dict[str, Any] | None = None  # the message item being streamed
        text = ""
        usage, finish = None, "stop"
        try:
            yield self._event("response.created", response=self.response("in_progress", [], None))
            yield self._event("response.in_progress", response=self.response("in_progress", [], None))
            async for chunk in chunks:
                for data in _frames(chunk):
                    if "error" in data:  # the chat stream failed mid-way: so does the response
                        err = data["error"]
                        yield self._event("error", code=err.get("code"), message=err.get("message"), param=None)
                        return
                    usage = data.get("usage") or usage
                    for choice in data.get("choices") or []:
                        delta = choice.get("delta") or {}
                        if delta.get("content"):
                            if message is None:
                                message = _message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress")
                                message["content"] = []
                                output.append(message)
                                index = len(output) - 1
                                yield self._event("response.output_item.added", output_index=index, item=message)
                                yield self._event("response.content_part.added", item_id=message["id"],
                                                  output_index=index, content_index=0, part=_text_part(""))
                            text += delta["content"]
                            yield self._event("response.output_text.delta", item_id=message["id"],
                                              output_index=output.index(message), content_index=0,
                                              delta=delta["content"], logprobs=[])
                        for call in delta.get("tool_calls") or []:
                            if message is not None and message["status"] == "in_progress":
                                async for e in self._finish_message(message, output, text):
                                    yield e
                            item = _call_item(call, "in_progress")
                            output.append(item)
                            index = len(output) - 1
                            yield self._event("response.output_item.added", output_index=index,
                                              item={**item, "arguments": ""})
                            yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                                              output_index=index, delta=item["arguments"])
                            yield self._event("response.function_call_arguments.done", item_id=item["id"],
                                              output_index=index, arguments=item["arguments"])
                            item["status"] = "completed"
                            yield self._event("response.output_item.done", output_index=index, item=item)
                        finish = choice.get("finish_reason") or finish
            if message is not None and message["status"] == "in_progress":
                async for e in self._finish_message(message, output, text):
                    yield e
            # response.completed even when max_output_tokens cut it (its status then says incomplete), as vLLM
            # sends it: the openai client's stream helper ends only on that event.
            yield self._event("response.completed", response=self.response(_status(finish), output, usage))
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _finish_message(self, message: dict[str, Any], output: list[dict[str, Any]],
                              text: str) -> AsyncIterator[bytes]:
        index = output.index(message)
        yield self._event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                          text=text, logprobs=[])
        yield self._event("response.content_part.done", item_id=message["id"], output_index=index, content_index=0,
                          part=_text_part(text))
        message["content"] = [_text_part(text)]
        message["status"] = "completed"
        yield self._event("response.output_item.done", output_index=index, item=message)

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _frames(chunk: bytes) -> list[dict[str, Any]]:
    """The JSON objects of a chat stream's SSE bytes (the final [DONE] is left out)."""
    out = []
    for frame in chunk.split(b"\n\n"):
        if frame.startswith(b"data: ") and not frame.endswith(DONE.strip()):
            out.append(orjson.loads(frame[6:]))
    return out


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [_text_part(text)]}


def _call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    fn = call["function"]
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": status}


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached or 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}
