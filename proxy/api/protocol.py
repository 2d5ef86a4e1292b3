"""OpenAI request bodies as pydantic models, validated as OpenAI and the engine validate them.

Unknown fields are ignored (as vLLM does: clients send many optional knobs); known fields we
cannot honour (``suffix``, ``best_of`` > 1...) are refused with a 400 rather than
silently ignored. The engine's limits (``engine.sampling_params``) are checked here too, so a bad
request never costs a round trip to a node.
"""

from __future__ import annotations

import array
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.wire import structured_to_pb
from engine.sampling_params import MAX_LOGPROBS
from engine.structured_output import StructuredOutputsParams
from proxy.api import structured

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_CHOICES = 128  # n times the number of prompts: choices in one request


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage (so far) on every chunk, with include_usage


class _Sampling(_Request):
    """Fields both endpoints share. ``None`` means "the default", as clients often send nulls."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2 ** 16)  # vLLM's extension
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's JSON) -> [-100, 100]
    user: str | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:<id>"
    # Structured output (proxy.api.structured): OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _constraint: StructuredOutputsParams | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 or t >= 2**32 for t in v):
            raise ValueError("stop_token_ids must be token ids (>= 0)")
        return v

    @model_validator(mode="after")
    def _check_unsupported(self) -> _Sampling:
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given with stream: true")  # (as vLLM answers)
        self.token_bias()  # raises on a bad key or value
        self._constraint = structured.resolve(self.response_format, self.structured_outputs, {
            "json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
            "grammar": self.guided_grammar})
        if self.min_tokens and self.max_output_tokens is not None and self.min_tokens > self.max_output_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_output_tokens})")
        return self

    def token_bias(self) -> dict[int, float]:
        """``logit_bias`` with token ids as ints; ValueError for a key that is not one, or a value
        outside [-100, 100] (the vocabulary bound is the caller's: ``Serving`` knows the model)."""
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if not 0 <= token < 2 ** 32:
                raise ValueError(f"logit_bias key {key!r} is not a token id")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
            out[token] = float(bias)
        return out

    @property
    def max_output_tokens(self) -> int | None:
        """The requested output length; None: up to the context limit."""
        return self.max_tokens

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def top_logprobs_n(self) -> int | None:
        """How many top logprobs per token to return; None: no logprobs at all."""
        raise NotImplementedError

    def sampling(self, max_tokens: int) -> pb.SamplingParams:
        """The node-side sampling parameters, with ``max_tokens`` resolved by the caller. Fields at
        their proto3 default (0, empty) are left unset: the same message, built for less (each field
        given costs a lookup and a conversion, on every request)."""
        params = pb.SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            max_tokens=max_tokens,
            repetition_penalty=self.repetition_penalty or 1.0,
        )
        if self.top_k:
            params.top_k = self.top_k
        if self.min_tokens:
            params.min_tokens = self.min_tokens
        stop = self.stop_list
        if stop:
            params.stop.extend(stop)
        if self.stop_token_ids:
            params.stop_token_ids.extend(self.stop_token_ids)
        if self.ignore_eos:
            params.ignore_eos = True
        if self.presence_penalty:
            params.presence_penalty = self.presence_penalty
        if self.frequency_penalty:
            params.frequency_penalty = self.frequency_penalty
        if self.min_p:
            params.min_p = self.min_p
        if self.logit_bias:
            params.logit_bias.update(self.token_bias())
        if self.seed is not None:
            params.seed = self.seed
        if self.top_logprobs_n is not None:
            params.logprobs = self.top_logprobs_n
        constraint = (self.__pydantic_private__ or {}).get("_constraint")  # not via __getattr__ (1.8 us)
        if constraint is not None:
            params.structured_output.CopyFrom(structured_to_pb(constraint))
        return params

    @property
    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output asked for (compiled when the request was validated), or None."""
        return self._constraint

    def constrain(self, constraint: StructuredOutputsParams, by: str) -> None:
        """Hold the output to ``constraint``, which ``by`` (a field) asks for; a 400 when another one does."""
        if self._constraint is not None:
            raise ValueError(f"{by} constrains the output already: it cannot be combined with response_format, "
                             "structured_outputs or guided_*")
        self._constraint = constraint


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's and vLLM's default for completions (chat has none: up to the context limit).
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def sampling(self, max_tokens: int) -> pb.SamplingParams:
        params = super().sampling(max_tokens)
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs, from the prefill node
            params.prompt_logprobs = self.logprobs
        return params

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one text or list of ids, or several (a batch: one choice each, times ``n``)."""
        v = self.prompt
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            return list(v)
        return [v]  # type: ignore[list-item]

    @field_validator("prompt")
    @classmethod
    def _check_prompts(cls, v: Any) -> Any:
        # A list of strings or of token lists is a batch of prompts.
        batch = v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if len(batch) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} prompts in one request, got {len(batch)}")
        for p in batch:
            if isinstance(p, list):
                if not p:
                    raise ValueError("a prompt must not be empty")
                try:  # ints in [0, 2**32), checked by array's C loop: prompts are long
                    array.array("I", p)
                except (TypeError, OverflowError):
                    raise ValueError("prompt token ids must be ints >= 0") from None
            elif not isinstance(p, str):
                raise ValueError("a prompt is a string or a list of token ids")
        return v

    @model_validator(mode="after")
    def _check_completion_unsupported(self) -> CompletionRequest:
        if self.best_of not in (None, 1):
            raise ValueError("best_of must be 1 (as in vLLM's V1 engine)")
        if (self.n or 1) * len(self.prompts()) > MAX_CHOICES:
            raise ValueError(f"n times the number of prompts must be at most {MAX_CHOICES}")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    @property
    def top_logprobs_n(self) -> int | None:
        return self.logprobs


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str = Field(min_length=1)
    arguments: str = ""


class MessageToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def as_template_input(self) -> dict[str, Any]:
        """The message as the chat template reads it: text parts joined, "developer" as "system",
        an assistant's tool calls and a tool answer's call id passed on."""
        if isinstance(self.content, list):
            text = "".join(p.text for p in self.content)
        else:
            text = self.content or ""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionSpec(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionSpec


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct function names")
        choice = self.tool_choice
        if isinstance(choice, dict):
            function = choice.get("function") if choice.get("type") == "function" else None
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str):
                raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                 '"function": {"name": ...}}')
            if name not in names:
                raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        elif choice == "required" and not names:
            raise ValueError('tool_choice "required" needs tools')
        return self

    @property
    def tools_on(self) -> bool:
        """Whether the tools are offered (rendered into the prompt, and calls read from the answer)."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools or []] if self.tools_on else None

    @property
    def max_output_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; it wins when both are given.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top_logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Request):
    """``POST /tokenize`` (vLLM's): a prompt's text, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give prompt or messages (one of them)")
        return self


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("tokens must be token ids (>= 0)")
        return v
