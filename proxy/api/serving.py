"""The generation endpoints: ``/v1/completions`` and ``/v1/chat/completions``.

Per request: parse and validate the body, check the model, tokenize (chat template for chat),
resolve ``max_tokens`` against the context limit, then run the ``Pipeline`` and turn its tokens
into text (``OutputText``) and OpenAI's shapes (``responses``). Prefill runs before the response
starts, so its errors are HTTP errors; decode errors after a stream started become an SSE error
event. The client leaving cancels the work at any point; ``Generation.close`` cleans up.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from cluster.nodes import NodeState
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from engine.tokenizer import Tokenizer
from proxy.api.choices import Child, Choices
from proxy.api.detok import OutputText
from proxy.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from proxy.api.responses import ChatFormat, CompletionFormat, Format, TokenTexts, sse, usage
from proxy.api.responses_api import ResponsesRequest, ResponseView
from proxy.api.sse import ClientDisconnected, ClientWatch, EventStreamResponse, until_disconnected
from proxy.api.tool_calls import MARKERS, ToolCallStream, forced_prefix, lark_literal
from proxy.api.tool_calls import constraint as tool_constraint
from proxy.errors import APIError, bad_request, error_body, model_not_found, validation_error
from proxy.metrics import ProxyMetrics
from proxy.pipeline import Generation, GenerationError, GenerationRequest, Pipeline
from proxy.routing.discovery import NodeView, context_limit

log = logging.getLogger(__name__)

R = TypeVar("R", bound=BaseModel)
Piece = tuple[str, list[pb.Token], str]  # (text, its tokens, finish reason or "")


class Serving:
    """Handlers of the two generation endpoints for one served model."""

    def __init__(self, *, model_name: str, tokenizer: Tokenizer, view: NodeView, pipeline: Pipeline,
                 metrics: ProxyMetrics, max_model_len: int, vocab_size: int | None = None,
                 max_inflight: int = 0) -> None:
        self.model_name = model_name
        self.max_inflight = max_inflight  # 0: no limit
        self.inflight = 0  # generation requests this proxy holds (the event loop's thread only)
        self.tokenizer = tokenizer
        self.view = view
        self.pipeline = pipeline
        self.metrics = metrics
        self.max_model_len = max_model_len  # the model's own limit, when no node says otherwise
        self.vocab_size = vocab_size  # token ids in a prompt must be below it (None: the nodes check)
        self.texts = TokenTexts(tokenizer)
        self.tool_markers = tokenizer.special_ids(MARKERS)  # kept in the text when tools are offered
        # How a tool-call grammar names each marker: a special token by its id (llguidance lets a grammar
        # produce special tokens only by id), else its text.
        self.grammar_markers = {m: _marker_rule(m, tokenizer, self.tool_markers) for m in MARKERS}

    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        body = await _json_body(request)
        req = _validate(CompletionRequest, body)
        self._check_model(req.model)
        given = req.prompts()
        prompts = [list(p) if isinstance(p, list) else self.tokenizer.encode(p) for p in given]
        for ids in prompts:
            if self.vocab_size is not None and ids and max(ids) >= self.vocab_size:
                raise bad_request(f"prompt token id {max(ids)} is outside the model's vocabulary (size "
                                  f"{self.vocab_size})", param="prompt")
        # echo: the prompt as given (ids: their text), before the answer
        echo = [p if isinstance(p, str) else self.tokenizer.decode(ids, skip_special_tokens=False)
                for p, ids in zip(given, prompts)] if req.echo else None
        if len(prompts) > 1 or (req.n or 1) > 1:
            return await self._several(request, req, prompts, "completions", "cmpl", "prompt", arrival, echo)
        return await self._generate(request, req, prompts[0], "completions", "cmpl", "prompt", arrival,
                                    echo[0] if echo else None)

    async def chat(self, request: Request) -> Response:
        arrival = time.perf_counter()
        req = _validate(ChatCompletionRequest, await _json_body(request))
        return await self._chat(request, req, arrival)

    async def responses(self, request: Request) -> Response:
        """OpenAI's ``POST /v1/responses``, served as the chat completion it asks for (``responses_api``)."""
        arrival = time.perf_counter()
        rreq = _validate(ResponsesRequest, await _json_body(request))
        try:
            chat = rreq.chat_body()
        except ValueError as e:
            raise bad_request(str(e)) from None
        view = ResponseView(rreq, int(time.time()), self.model_name)
        answer = await self._chat(request, _validate(ChatCompletionRequest, chat), arrival)
        if isinstance(answer, EventStreamResponse):
            return answer.mapped(view.events)
        return JSONResponse(view.from_chat(orjson.loads(bytes(answer.body))))

    async def _chat(self, request: Request, req: ChatCompletionRequest, arrival: float) -> Response:
        self._check_model(req.model)
        messages = [m.as_template_input() for m in req.messages]
        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=req.template_tools())
        except Exception as e:  # the template is the model's code: any failure is about these messages
            raise bad_request(f"the chat template failed on these messages: {e}", param="messages") from None
        prefix = forced_prefix(req.tool_choice) if req.tools_on and req.tool_choice not in (None, "auto") else ""
        if prefix:  # "required" or a named function: the answer starts inside a call, held to the tools' schemas
            ids = ids + self.tokenizer.encode(prefix, add_special_tokens=False)
            assert req.tool_choice is not None
            specs = [(t.function.name, t.function.parameters) for t in req.tools or []]
            try:
                req.constrain(tool_constraint(req.tool_choice, specs, self.grammar_markers.__getitem__,
                                              parallel=req.parallel_tool_calls is not False), "tool_choice")
            except ValueError as e:  # a schema that does not compile, or another constraint beside it
                raise bad_request(str(e), param="tool_choice") from None
        tools = prefix if req.tools_on else None
        if (req.n or 1) > 1:
            return await self._several(request, req, [ids], "chat", "chatcmpl", "messages", arrival, tools=tools)
        return await self._generate(request, req, ids, "chat", "chatcmpl", "messages", arrival, tools=tools)

    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's ``POST /tokenize``: a prompt (or chat messages, through the chat template) as token ids."""
        req = _validate(TokenizeRequest, await _json_body(request))
        self._check_model(req.model)
        if req.messages is not None:
            try:
                ids = self.tokenizer.apply_chat_template([m.as_template_input() for m in req.messages],
                                                         add_generation_prompt=req.add_generation_prompt)
            except Exception as e:
                raise bad_request(f"the chat template failed on these messages: {e}", param="messages") from None
        else:
            assert req.prompt is not None
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        limit = context_limit(self.view.snapshot(), self.model_name, self.max_model_len)
        strs = [self.texts.shown(t) for t in ids] if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's ``POST /detokenize``: token ids back to text."""
        req = _validate(DetokenizeRequest, await _json_body(request))
        self._check_model(req.model)
        if self.vocab_size is not None and req.tokens and max(req.tokens) >= self.vocab_size:
            raise bad_request(f"token id {max(req.tokens)} is outside the model's vocabulary (size "
                              f"{self.vocab_size})", param="tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens)})

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise model_not_found(model)

    def _checked_max_tokens(self, req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                            nodes: list[NodeState], prompt_param: str) -> int:
        """``max_tokens`` for the nodes (400 when the prompt and the output cannot fit, or for a
        ``min_tokens`` above it, or a ``logit_bias`` token outside the vocabulary)."""
        max_tokens = _resolve_max_tokens(req.max_output_tokens, len(prompt_ids),
                                         context_limit(nodes, self.model_name, self.max_model_len), prompt_param)
        if req.min_tokens and req.min_tokens > max_tokens:
            raise bad_request(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})", param="min_tokens")
        if req.logit_bias and self.vocab_size is not None:
            outside = [t for t in req.token_bias() if t >= self.vocab_size]
            if outside:
                raise bad_request(f"logit_bias token id {outside[0]} is outside the model's vocabulary (size "
                                  f"{self.vocab_size})", param="logit_bias")
        return max_tokens

    def _format(self, req: CompletionRequest | ChatCompletionRequest, request_id: str, endpoint: str,
                index: int = 0, tools: str | None = None) -> Format:
        """The response shapes of one choice; ``tools`` (chat with tools offered): the answer's forced
        start ("" for none), and tool calls are read out of it."""
        if endpoint == "chat":
            fmt = ChatFormat(request_id, int(time.time()), self.model_name, logprobs=req.top_logprobs_n is not None,
                             include_usage=req.include_usage, texts=self.texts,
                             token_ids=req.return_tokens_as_token_ids, index=index)
            if tools is not None:
                fmt.offer_tools(ToolCallStream(tools))
            return fmt
        return CompletionFormat(request_id, int(time.time()), self.model_name, logprobs=req.top_logprobs_n is not None,
                                include_usage=req.include_usage, texts=self.texts,
                                token_ids=req.return_tokens_as_token_ids, index=index)

    def _output(self, req: CompletionRequest | ChatCompletionRequest, tools: str | None) -> OutputText:
        """The answer's text; with tools offered, the call markers' text kept (if they are special tokens)."""
        return OutputText(self.tokenizer, req.stop_list, self.tool_markers if tools is not None else frozenset())

    def _admit(self) -> None:
        """Count a request in flight, or refuse it (503) at ``max_inflight``."""
        if self.max_inflight and self.inflight >= self.max_inflight:
            raise APIError(503, f"the proxy has {self.inflight} requests in flight (max_inflight_requests "
                                f"{self.max_inflight}); try again shortly", code="overloaded", cause="proxy_full",
                           retry_after_s=1)
        self.inflight += 1
        self.metrics.inflight.inc()

    def _leave(self) -> None:
        self.inflight -= 1
        self.metrics.inflight.dec()

    async def _several(self, request: Request, req: CompletionRequest | ChatCompletionRequest,
                       prompts: list[list[int]], endpoint: str, id_prefix: str, prompt_param: str,
                       arrival: float, echo: list[str] | None = None, tools: str | None = None) -> Response:
        """``n`` > 1 samples and several prompts: one choice each (``proxy.api.choices``)."""
        nodes = self.view.snapshot()
        n = req.n or 1
        request_id = f"{id_prefix}-{_new_id()}"
        children = []
        for p, ids in enumerate(prompts):
            max_tokens = self._checked_max_tokens(req, ids, nodes, prompt_param)
            self._check_kv_budget(nodes, len(ids) + max_tokens, n)
            for i in range(n):
                sampling = req.sampling(max_tokens)
                if sampling.HasField("seed"):
                    sampling.seed = (sampling.seed + i) % 2 ** 63  # vLLM's rule: sample i gets seed + i
                k = p * n + i
                child_req = GenerationRequest(request_id=f"{request_id}-{k}", endpoint=endpoint,
                                              prompt_token_ids=list(ids), sampling=sampling, arrival=arrival)
                children.append(Child(child_req, self._format(req, request_id, endpoint, k, tools),
                                      self._output(req, tools), p, i == 0, echo=echo[p] if echo else None))
        choices = Choices(self.pipeline, self.metrics, children, nodes, _pieces)
        self._admit()
        handed_off = False
        try:
            await until_disconnected(request, choices.start())
            if not req.stream:
                body = await until_disconnected(request, choices.complete())
                self.metrics.observe(self.metrics.e2e, time.perf_counter() - arrival, (endpoint,))
                return JSONResponse(body)

            def close(disconnected: bool) -> None:
                choices.close()
                self._leave()
                if disconnected:
                    self.metrics.errors.labels("client_disconnect").inc()

            handed_off = True
            return EventStreamResponse(choices.events(req.include_usage, req.continuous_usage), on_close=close,
                                       watch=ClientWatch.of(request))
        except ClientDisconnected:
            self.metrics.errors.labels("client_disconnect").inc()
            return Response(status_code=499)
        finally:
            if not handed_off:
                ClientWatch.of(request).close()
                choices.close()
                self._leave()

    def _check_kv_budget(self, nodes: list[NodeState], tokens: int, n: int) -> None:
        """400 when ``n`` sequences of ``tokens`` cannot fit in the decode nodes' KV caches at once."""
        decode = [s for s in nodes if s.info.role == "decode" and s.info.model == self.model_name and s.healthy]
        if not decode:
            return  # no decode node known: routing answers 503 with its reasons
        have = sum(s.info.num_blocks * s.info.dp for s in decode)
        need = n * -(-tokens // decode[0].info.block_size)
        if need > have:
            raise bad_request(f"n={n} sequences of up to {tokens} tokens need {need} KV blocks; the decode nodes "
                              f"have {have} in all", param="n")

    async def _generate(self, request: Request, req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                        endpoint: str, id_prefix: str, prompt_param: str, arrival: float,
                        echo: str | None = None, tools: str | None = None) -> Response:
        """One choice (the common case, kept short); ``echo``: the prompt's text, echoed first; ``tools``:
        see ``_format``."""
        nodes = self.view.snapshot()
        max_tokens = self._checked_max_tokens(req, prompt_ids, nodes, prompt_param)
        gen_req = GenerationRequest(request_id=f"{id_prefix}-{_new_id()}", endpoint=endpoint,
                                    prompt_token_ids=list(prompt_ids), sampling=req.sampling(max_tokens),
                                    arrival=arrival)
        fmt = self._format(req, gen_req.request_id, endpoint, tools=tools)
        out = self._output(req, tools)
        self._admit()
        handed_off = False  # once the stream response owns the request, it ends it
        try:
            if not req.stream:
                body = await until_disconnected(request, self._complete(gen_req, nodes, fmt, out, echo))
                return JSONResponse(body)
            gen = await until_disconnected(request, self.pipeline.start(gen_req, nodes))
            if echo is not None:
                fmt.echo(echo, gen.prompt_tokens)

            def close(disconnected: bool) -> None:
                gen.close()
                self._leave()
                if disconnected:
                    self.metrics.errors.labels("client_disconnect").inc()

            handed_off = True
            return EventStreamResponse(self._events(gen, fmt, out, req.include_usage, req.continuous_usage),
                                       on_close=close, watch=ClientWatch.of(request))
        except ClientDisconnected:
            self.metrics.errors.labels("client_disconnect").inc()
            return Response(status_code=499)  # nobody reads it; the metrics middleware counts it
        finally:
            if not handed_off:
                ClientWatch.of(request).close()
                self._leave()

    async def _complete(self, req: GenerationRequest, nodes: list[NodeState], fmt: Format,
                        out: OutputText, echo: str | None = None) -> dict[str, Any]:
        gen = await self.pipeline.start(req, nodes)
        if echo is not None:
            fmt.echo(echo, gen.prompt_tokens)
        try:
            tokens: list[pb.Token] = []
            finish = ""
            async for _, piece_tokens, piece_finish in _pieces(gen, out):
                tokens += piece_tokens
                finish = piece_finish
            self.metrics.observe(self.metrics.e2e, time.perf_counter() - req.arrival, (req.endpoint,))
            return fmt.response(out.text, finish, tokens, usage(len(req.prompt_token_ids), len(tokens)))
        except GenerationError as e:
            raise e.error from None
        finally:
            gen.close()

    async def _events(self, gen: Generation, fmt: Format, out: OutputText, include_usage: bool,
                      continuous: bool = False) -> AsyncIterator[bytes]:
        """The SSE stream; with ``continuous`` (vLLM's ``continuous_usage_stats``) every chunk carries
        the usage so far."""
        req = gen.request
        prompt_tokens = len(req.prompt_token_ids)
        completion_tokens = 0

        def so_far(chunk: dict[str, Any]) -> dict[str, Any]:
            if continuous:
                chunk["usage"] = usage(prompt_tokens, completion_tokens)
            return chunk

        # Chunks ready together leave in one write; each goes out before the stream next waits. (The
        # loop is _pieces' own, inline: one generator less to pass for every decode event.)
        buf = [sse(so_far(chunk)) for chunk in fmt.first_chunks()]
        pending: list[pb.Token] = []  # the tokens since the last text sent
        try:
            while True:
                if buf and not gen.ready():  # the stream waits now: what is ready leaves first
                    yield b"".join(buf)
                    buf = []
                tokens, finish = await gen.next_tokens()
                if _add_tokens(out, tokens, pending):
                    finish = "stop"
                if not finish:
                    text = out.take()
                    if text:
                        completion_tokens += len(pending)
                        buf.append(sse(so_far(fmt.delta_chunk(text, pending))) if continuous
                                   else fmt.delta_event(text, pending))
                        pending = []
                    continue
                completion_tokens += len(pending)
                for chunk in fmt.final_chunks(out.finish(), pending, finish):
                    buf.append(sse(so_far(chunk)))
                if include_usage:
                    buf.append(sse(fmt.usage_chunk(usage(prompt_tokens, completion_tokens))))
                buf.append(sse("[DONE]"))
                self.metrics.observe(self.metrics.e2e, time.perf_counter() - req.arrival, (req.endpoint,))
                yield b"".join(buf)  # the stream's end: nothing runs after this yield (sse.EventStreamResponse)
                return
        except GenerationError as e:
            # Headers are gone already: the error travels as an event, and the stream ends without [DONE].
            log.warning("request %s failed mid-stream: %s", req.request_id, e.error.message)
            self.metrics.errors.labels(e.error.cause).inc()
            yield b"".join(buf) + sse(e.error.body())
        except Exception:
            log.exception("request %s failed mid-stream", req.request_id)
            self.metrics.errors.labels("internal").inc()
            yield b"".join(buf) + sse(error_body("internal server error", type="server_error", code="internal_error"))


def _add_tokens(out: OutputText, tokens: list[pb.Token], pending: list[pb.Token]) -> bool:
    """Add a decode event's tokens to the text and to ``pending``; whether a stop string ended the
    output (the tokens after the one that completed it are dropped)."""
    for t in tokens:
        pending.append(t)
        out.add(t.token_id)
        if out.stopped:
            return True
    return False


async def _pieces(gen: Generation, out: OutputText) -> AsyncIterator[Piece]:
    """Text as it becomes sendable, each piece with the tokens since the last; the last piece has the
    finish reason. Tokens after a stop string are dropped: the output ends there ("stop")."""
    pending: list[pb.Token] = []
    while True:
        tokens, finish = await gen.next_tokens()
        if _add_tokens(out, tokens, pending):
            finish = "stop"
        if finish:
            yield out.finish(), pending, finish
            return
        text = out.take()
        if text:
            yield text, pending, ""
            pending = []


def _resolve_max_tokens(requested: int | None, prompt_len: int, limit: int, prompt_param: str) -> int:
    """``max_tokens`` for the nodes: as requested, or up to the context limit; 400 if it cannot fit."""
    if prompt_len >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens, but the prompt has {prompt_len} "
                       "tokens (at least one output token must fit).", param=prompt_param,
                       code="context_length_exceeded")
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens, but {prompt_len} prompt tokens "
                       f"+ {requested} max_tokens = {prompt_len + requested}.", param="max_tokens",
                       code="context_length_exceeded")
    return requested


_ids = random.Random()  # seeded from the OS at import: each worker process draws its own sequence
os.register_at_fork(after_in_child=_ids.seed)  # and a forked one too (workers are spawned today)


def _new_id() -> str:
    """A request's id: 128 random bits in hex, as ``uuid4().hex`` but without a system call for each
    (``os.urandom`` was 3% of a worker's event loop under load). Ids only name requests (the nodes key
    their state by them); they grant nothing, so they need not be unpredictable."""
    return f"{_ids.getrandbits(128):032x}"


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return body


def _marker_rule(marker: str, tokenizer: Tokenizer, special: frozenset[int]) -> str:
    """``marker`` as a tool-call grammar names it (``proxy.api.tool_calls.constraint``)."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 and ids[0] in special else lark_literal(marker)


def _validate(model: type[R], body: dict[str, Any]) -> R:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(list(e.errors())) from None
