"""Several choices in one request: ``n`` > 1 samples of a prompt, and several prompts in one completion.

Each choice is a generation of its own through the pipeline (``Child``): choice ``p · n + i`` is
sample ``i`` of prompt ``p``, as OpenAI numbers them. With a ``seed``, sample ``i`` gets ``seed + i``
(vLLM's rule), so it equals a single request with that seed. A prompt's first sample starts at once;
its other samples start once the first one's KV is on its decode rank (``Generation.admitted``): by
then the prefill replica and the decode rank both hold the prompt's full blocks in their prefix
caches and the router sends the samples to them, so the prompt is computed and moved once and
each further sample prefills and pulls only its last partial block.

``Choices.complete`` gathers them into one response; ``Choices.events`` streams their chunks as they
come (each with its ``index``), then one usage chunk and ``[DONE]``. A failure of any choice ends
the request: an HTTP error before the stream starts, an error event after; every generation is
closed either way (``close``). Usage counts each prompt's tokens once and every choice's tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.nodes import NodeState
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from proxy.api.detok import OutputText
from proxy.api.responses import Format, sse, usage
from proxy.errors import APIError, error_body
from proxy.metrics import ProxyMetrics
from proxy.pipeline import Generation, GenerationError, GenerationRequest, Pipeline

log = logging.getLogger(__name__)

FOLLOW_WAIT_S = 60.0  # the longest further samples wait for their first sample's KV before starting anyway
PieceStream = Callable[[Generation, OutputText], AsyncIterator[tuple[str, list[pb.Token], str]]]


@dataclass
class Child:
    """One choice: its request (its own id, and seed), output text and response format."""

    req: GenerationRequest
    fmt: Format
    out: OutputText
    prompt: int  # which prompt it samples
    first: bool  # the prompt's first sample: the others follow it
    echo: str | None = None  # echo: the prompt's text, before the answer
    gen: Generation | None = None
    tokens: list[pb.Token] = field(default_factory=list)
    finish: str = ""


Item = tuple[Child, dict[str, Any] | BaseException | None]  # a chunk, the choice's error, or its end


class Choices:
    """The choices of one request (see the module docstring)."""

    def __init__(self, pipeline: Pipeline, metrics: ProxyMetrics, children: list[Child], nodes: list[NodeState],
                 pieces: PieceStream) -> None:
        self.pipeline = pipeline
        self.metrics = metrics
        self.children = children
        self.nodes = nodes
        self.pieces = pieces
        self.prompt_tokens = sum(len(c.req.prompt_token_ids) for c in children if c.first)
        self._followers: list[asyncio.Task[None]] = []
        self._started: dict[int, asyncio.Future[Generation]] = {}

    async def start(self) -> None:
        """Start every prompt's first sample (their prefill errors are the request's HTTP errors), and
        the others in the background, each after its prompt's first sample is admitted."""
        loop = asyncio.get_running_loop()
        self._started = {id(c): loop.create_future() for c in self.children}
        firsts = [c for c in self.children if c.first]
        results = await asyncio.gather(*(self._start(c) for c in firsts), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                self.close()
                raise r
        for c in self.children:
            if not c.first:
                lead = next(f for f in firsts if f.prompt == c.prompt)
                self._followers.append(asyncio.ensure_future(self._follow(lead, c)))

    async def _start(self, c: Child) -> Generation:
        fut = self._started[id(c)]
        try:
            c.gen = await self.pipeline.start(c.req, self.nodes)
            if c.echo is not None:
                c.fmt.echo(c.echo, c.gen.prompt_tokens)
        except BaseException as e:
            if not fut.done():
                fut.set_exception(e)
                fut.exception()  # retrieved: a follower that never asks must not warn
            raise
        fut.set_result(c.gen)
        return c.gen

    async def _follow(self, lead: Child, c: Child) -> None:
        assert lead.gen is not None
        try:
            await asyncio.wait_for(lead.gen.admitted.wait(), FOLLOW_WAIT_S)
        except TimeoutError:
            pass  # start anyway: it only loses the shared prefix
        try:
            await self._start(c)
        except BaseException:
            pass  # its future carries the error to whoever reads the choice

    async def _generation(self, c: Child) -> Generation:
        return await self._started[id(c)]

    async def complete(self) -> dict[str, Any]:
        """The whole response: every choice run to its end, in index order (the first failure cancels
        the others and is the request's)."""
        tasks = [asyncio.ensure_future(self._run(c)) for c in self.children]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        responses = [c.fmt.response(c.out.text, c.finish, c.tokens, {}) for c in self.children]
        body = responses[0]
        body["choices"] = [r["choices"][0] for r in responses]
        body["usage"] = usage(self.prompt_tokens, sum(len(c.tokens) for c in self.children))
        return body

    async def _run(self, c: Child) -> None:
        gen = await self._generation(c)
        try:
            async for _, tokens, finish in self.pieces(gen, c.out):
                c.tokens += tokens
                c.finish = finish
        except GenerationError as e:
            raise e.error from None
        finally:
            gen.close()  # at once: a choice cut by a stop string must not keep decoding on its node

    async def events(self, include_usage: bool, continuous: bool) -> AsyncIterator[bytes]:
        """The SSE stream: every choice's chunks as they come; with ``continuous`` (vLLM's
        ``continuous_usage_stats``) each carries the request's usage so far."""
        queue: asyncio.Queue[Item] = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._stream(c, queue)) for c in self.children]
        done = 0
        completion = 0
        try:
            while done < len(self.children):
                c, item = await queue.get()
                if item is None:
                    done += 1
                    continue
                if isinstance(item, BaseException):
                    error = item.error if isinstance(item, GenerationError) else item if isinstance(
                        item, APIError) else None
                    if error is not None:
                        log.warning("request %s failed mid-stream: %s", c.req.request_id, error.message)
                        self.metrics.errors.labels(error.cause).inc()
                        yield sse(error.body())
                    else:
                        log.error("request %s failed mid-stream: %r", c.req.request_id, item)
                        self.metrics.errors.labels("internal").inc()
                        yield sse(error_body("internal server error", type="server_error", code="internal_error"))
                    return
                completion = sum(len(x.tokens) for x in self.children)
                if continuous:
                    item["usage"] = usage(self.prompt_tokens, completion)
                yield sse(item)
            if include_usage:
                yield sse(self.children[0].fmt.usage_chunk(usage(self.prompt_tokens, completion)))
            first = self.children[0].req
            self.metrics.observe(self.metrics.e2e, time.perf_counter() - first.arrival, (first.endpoint,))
            yield sse("[DONE]")  # the stream's end: nothing runs after this yield (sse.EventStreamResponse)
        finally:
            for t in tasks:
                t.cancel()

    async def _stream(self, c: Child, queue: asyncio.Queue[Item]) -> None:
        try:
            gen = await self._generation(c)
            for chunk in c.fmt.first_chunks():
                queue.put_nowait((c, chunk))
            async for text, tokens, finish in self.pieces(gen, c.out):
                c.tokens += tokens
                if not finish:
                    queue.put_nowait((c, c.fmt.delta_chunk(text, tokens)))
                    continue
                c.finish = finish
                for chunk in c.fmt.final_chunks(text, tokens, finish):
                    queue.put_nowait((c, chunk))
            queue.put_nowait((c, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            queue.put_nowait((c, e))
        finally:
            if c.gen is not None:
                c.gen.close()  # at once: a choice cut by a stop string must not keep decoding on its node

    def close(self) -> None:
        """End every choice (idempotent): followers not started are cancelled, generations closed."""
        for t in self._followers:
            t.cancel()
        for fut in self._started.values():
            if not fut.done():
                fut.cancel()  # a choice waiting for a generation that will never start ends too
        for c in self.children:
            if c.gen is not None:
                c.gen.close()
