"""The engine loop: requests in, one scheduled forward step at a time, finished requests out.

Lifecycle of a request: ``add_request`` (validated, WAITING) -> scheduled in steps (RUNNING, its
blocks allocated as its tokens are computed) -> finished by a stop condition or ``abort`` (its
blocks freed at once). ``num_used_blocks`` is 0 whenever no request is in flight.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.kv_cache import KVCache, bytes_per_block
from engine.model_runner import ModelRunner, StepLogits
from engine.sampler import sample, top_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduled, Scheduler
from engine.sequence import SeqStatus, Sequence
from engine.tokenizer import Tokenizer
from engine.weights import build_empty_model, init_random_weights, load_weights

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        mc = self.model_config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(mc.torch_dtype)
        if self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{mc.max_position_embeddings}"
            )
        t0 = time.perf_counter()
        self.model = build_empty_model(mc, self.dtype, self.device)
        if config.load_format == "dummy":
            init_random_weights(self.model, config.seed)
        else:
            load_weights(self.model, config.model)
        log.info("loaded %s in %.1fs", config.model, time.perf_counter() - t0)
        self.cache = KVCache(
            mc, range(mc.num_hidden_layers), self._num_blocks(), config.block_size, self.dtype, self.device
        )
        self.runner = ModelRunner(self.model, self.cache, self.device)
        self.scheduler = Scheduler(
            self.cache.allocator, config.block_size, config.max_num_batched_tokens, config.max_num_seqs
        )
        self.tokenizer = None if config.skip_tokenizer_init else Tokenizer(config.tokenizer or config.model)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._requests: dict[str, Sequence] = {}
        self._ids = itertools.count()

    def _num_blocks(self) -> int:
        cfg, mc = self.config, self.model_config
        per_block = bytes_per_block(mc, cfg.block_size, self.dtype, mc.num_hidden_layers)
        needed_min = -(-self.max_model_len // cfg.block_size)
        full = needed_min * cfg.max_num_seqs  # every slot filled to max_model_len: never more useful
        if cfg.num_kv_blocks is not None:
            n = cfg.num_kv_blocks
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            reserve = total * (1 - cfg.gpu_memory_utilization) + 2 * 2**30  # activations and workspace
            n = min(full, int(max(0, free - reserve) // per_block))
        else:
            n = min(full, int(cfg.cpu_kv_cache_gb * 2**30 // per_block))
        if n < needed_min:
            raise ValueError(
                f"KV cache of {n} blocks of {cfg.block_size} tokens cannot hold one request of max_model_len "
                f"{self.max_model_len} ({needed_min} blocks): lower max_model_len or give the cache more memory"
            )
        return n

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        want_prompt_logits: bool = False,
    ) -> Sequence:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text = prompt if isinstance(prompt, str) else None
        ids = self._tokenize(prompt)
        n = len(ids)
        if n == 0:
            raise ValueError("prompt is empty")
        if n > self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, more than max_model_len {self.max_model_len}")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.model_config.vocab_size}): {bad[:5]}")
        room = self.max_model_len - n
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            max_tokens=max_tokens,
            eos_token_ids=self.model_config.eos_token_ids,
            prompt=text,
            generator=gen,
            want_prompt_logits=want_prompt_logits,
        )
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set): pass token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise TypeError("a prompt must be a string or a list of token ids (ints)")
        return list(prompt)

    def abort(self, request_id: str) -> bool:
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_used_blocks(self) -> int:
        return self.cache.allocator.num_used

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one forward step. Returns the requests that finished in it."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress (KV cache too small for any waiting request)")
            return []
        step_logits = self.runner.run(scheduled)
        finished: list[Sequence] = []
        to_sample: list[tuple[Sequence, torch.Tensor]] = []
        for s, sl in zip(scheduled, step_logits):
            self._record_prompt_logits(s, sl)
            if s.samples:
                assert sl is not None
                to_sample.append((s.seq, sl.logits[-1]))
            s.seq.num_computed += s.num_new
        if to_sample:
            seqs = [q for q, _ in to_sample]
            for seq, smp in zip(seqs, sample(torch.stack([lg for _, lg in to_sample]), seqs, self.generator)):
                if self._append(seq, smp.token, smp.logprob, smp.top):
                    finished.append(seq)
        for seq in finished:
            self._requests.pop(seq.request_id, None)
        return finished

    def _record_prompt_logits(self, s: Scheduled, sl: StepLogits | None) -> None:
        seq = s.seq
        if sl is None or sl.logits.shape[0] < s.num_new:
            return
        start = seq.num_computed
        done = len(seq.prompt_logits) if seq.want_prompt_logits else len(seq.prompt_logprobs)
        if start < done:
            return  # recomputation after preemption: already recorded
        n_prompt = len(seq.prompt_token_ids)
        rows = min(s.num_new, n_prompt - start)
        if seq.want_prompt_logits:
            seq.prompt_logits.extend(sl.logits[:rows].cpu())
        k = seq.params.prompt_logprobs
        if k is None:
            return
        if start == 0:
            seq.prompt_logprobs.append(None)  # the first prompt token has no logprob
            seq.prompt_top_logprobs.append(None)
        # Row i predicts prompt token start+i+1; the last prompt row predicts the first output.
        targets = seq.prompt_token_ids[start + 1 : start + rows + 1]
        logp = torch.log_softmax(sl.logits[: len(targets)], dim=-1)
        chosen = logp.gather(1, torch.tensor(targets, device=logp.device).unsqueeze(1)).squeeze(1)
        seq.prompt_logprobs.extend(chosen.tolist())
        seq.prompt_top_logprobs.extend(top_logprobs(logp, k))

    def _append(self, seq: Sequence, token: int, logprob: float, top: dict[int, float] | None) -> bool:
        """Add a sampled token; returns True when the request finished (its blocks are then free)."""
        p = seq.params
        if seq.max_tokens == 0:
            self.scheduler.finish(seq, "length")
            return True
        seq.output_token_ids.append(token)
        seq.logprobs.append(logprob)
        if top is not None:
            seq.top_logprobs.append(top)
        reason = None
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_tokens:
            if token in (p.stop_token_ids or ()) or (not p.ignore_eos and token in seq.eos_token_ids):
                reason = "stop"
            elif p.stop_strings and self.tokenizer is not None and self._hit_stop_string(seq):
                reason = "stop"
        if reason is None and n_out >= seq.max_tokens:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            return True
        return False

    def _hit_stop_string(self, seq: Sequence) -> bool:
        assert self.tokenizer is not None
        text = self.tokenizer.decode(seq.output_token_ids, seq.params.skip_special_tokens)
        for stop in seq.params.stop_strings:
            idx = text.find(stop)
            if idx >= 0:
                seq.text = text[:idx]
                return True
        return False

    def detokenize(self, seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        if seq.finish_reason == "stop" and seq.params.stop_strings and seq.text:
            return seq.text
        return self.tokenizer.decode(seq.output_token_ids, seq.params.skip_special_tokens)

    def status(self) -> dict[str, int]:
        return {
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "used_blocks": self.num_used_blocks,
            "free_blocks": self.cache.allocator.num_free,
        }



__all__ = ["LLMEngine", "SeqStatus"]
