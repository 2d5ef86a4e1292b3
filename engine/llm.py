"""Offline API, shaped like vLLM's ``LLM``::

    from engine import LLM, SamplingParams
    with LLM(model="DIR", dtype="float32", max_model_len=4096, max_num_batched_tokens=2048) as llm:
        outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0, logprobs=1))
        outs[0].token_ids, outs[0].text, outs[0].logprobs
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from engine.cache_export import CacheExporter
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine, resolve_max_model_len
from engine.parallel.expert_parallel import expert_shard, spans_dp
from engine.parallel.replica import ParallelNode
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] | None  # chosen-token logprob per output position (when logprobs was set)
    top_logprobs: list[dict[int, float]] | None
    prompt_logprobs: list[float | None] | None  # per prompt position; None for the first
    prompt_top_logprobs: list[dict[int, float] | None] | None


def _output(engine: LLMEngine, seq: Sequence) -> RequestOutput:
    p = seq.params
    return RequestOutput(
        request_id=seq.request_id,
        prompt=seq.prompt,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=list(seq.output_token_ids),
        text=engine.detokenize(seq),
        finish_reason=seq.finish_reason,
        logprobs=list(seq.logprobs) if p.logprobs is not None else None,
        top_logprobs=list(seq.top_logprobs) if p.logprobs is not None else None,
        prompt_logprobs=list(seq.prompt_logprobs) if p.prompt_logprobs is not None else None,
        prompt_top_logprobs=list(seq.prompt_top_logprobs) if p.prompt_logprobs is not None else None,
    )


class LLM:
    """A model generating for batches of prompts (strings or token-id lists).

    In this process by default; with a topology (``dp``, ``pcp``, ``pp`` > 1, ``kv_layout``) on
    rank processes, with the same results::

        LLM(model=DIR, pcp=2, pp=2, dp=1, kv_layout="sharded")
    """

    def __init__(self, model: str, cache_exporter: CacheExporter | None = None, **kwargs: Any) -> None:
        """``cache_exporter``: registers every rank's KV cache with a node's transport (see
        ``engine.cache_export``); its answers are ``cache_exports`` (rank -> answer)."""
        self._start(EngineConfig(model=model, **kwargs), cache_exporter)

    @classmethod
    def from_config(cls, config: EngineConfig, cache_exporter: CacheExporter | None = None) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config, cache_exporter)
        return llm

    def _start(self, config: EngineConfig, exporter: CacheExporter | None) -> None:
        par = config.parallel()
        self.node: ParallelNode | None = None
        self._exporter: CacheExporter | None = None  # the in-process cache's, closed at shutdown
        self.cache_exports: dict[int, object] = {}
        if par.world_size == 1:
            self.engines = [LLMEngine(config)]
            if exporter is not None:
                self._exporter = exporter  # closed by shutdown, also when export fails partway
                self.cache_exports = {0: exporter.export(self.engines[0].cache_layers)}
        else:
            mc = ModelConfig.from_pretrained(config.model)
            expert_shard(config, mc)  # experts that do not divide over the ranks: refused before they start
            # The driver only schedules and samples on the host: small tensors, for which torch's
            # OpenMP pool costs more in wake-ups than it saves (measured: plan building 5x slower).
            torch.set_num_threads(config.cpu_threads)
            self.node = ParallelNode(config, resolve_max_model_len(config, mc), exporter)
            self.cache_exports = dict(self.node.cache_exports)
            try:
                self.engines = [LLMEngine(config, self.node.replica(d)) for d in range(par.dp)]
            except BaseException:
                self.node.shutdown()
                raise
            for e in self.engines:
                e.lockstep = spans_dp(config)
        self.engine = self.engines[0]

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion; outputs come back in the prompts' order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        seqs = self._run(prompts, params)
        return [_output(self.engine, s) for s in seqs]

    def prompt_logits(self, prompts: Seq[list[int]]) -> list[torch.Tensor]:
        """Logits [len, V] (fp32, CPU) at every prompt position, computed through the engine's paged path."""
        params = [SamplingParams(max_tokens=0, temperature=0.0)] * len(prompts)
        seqs = self._run(list(prompts), params, want_prompt_logits=True)
        return [torch.stack(s.prompt_logits) for s in seqs]

    def _run(
        self, prompts: list[Any], params: list[SamplingParams], want_prompt_logits: bool = False
    ) -> list[Sequence]:
        placed: list[tuple[LLMEngine, Sequence]] = []
        load = [0] * len(self.engines)
        try:
            for prompt, p in zip(prompts, params):
                d = load.index(min(load))  # DP: the replica with the fewest requests of this call
                load[d] += 1
                eng = self.engines[d]
                placed.append((eng, eng.add_request(prompt, p, want_prompt_logits=want_prompt_logits)))
            self._step_until_done()
        except BaseException:
            for eng, s in placed:  # leave nothing behind on error or interrupt
                eng.abort(s.request_id)
            raise
        return [s for _, s in placed]

    def _step_until_done(self) -> None:
        try:
            while busy := self.to_step():
                for e in busy:  # replicas compute concurrently: launch all, then collect
                    e.launch_step()
                for e in busy:
                    e.finish_step()
                for e in busy:  # (EP across DP on rank processes: every replica's MTP pass asked for first)
                    e.settle_drafts()
        except BaseException as exc:
            # Interrupted or failed between sending a step and reading its answer: the ranks' pipes
            # and collectives are out of step with the driver, so the node cannot be reused.
            if self.node is not None:
                self.node.shutdown(why=f"a step was interrupted ({type(exc).__name__})")
            raise

    def to_step(self) -> list[LLMEngine]:
        """The replicas to step now: those with work, or all of them while any has work when they step in
        lockstep (expert parallelism across DP: the idle ones run steps without rows)."""
        busy = [e for e in self.engines if e.has_unfinished()]
        return list(self.engines) if busy and self.engine.lockstep else busy

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the rank processes (if any) and release the model and cache memory."""
        node = getattr(self, "node", None)
        if node is not None:
            node.shutdown()
            self.node = None
        exporter = getattr(self, "_exporter", None)
        if exporter is not None:
            exporter.close()
            self._exporter = None
        if getattr(self, "engine", None) is not None:
            del self.engine
            self.engines = []
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
