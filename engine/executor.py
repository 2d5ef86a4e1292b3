"""Executors run the engine's scheduled steps: in this process (``LocalExecutor``) or on the rank
processes of a DP replica (``engine.parallel.replica.ReplicaExecutor``).

A step is split in two so a driver can keep several DP replicas busy at once: ``launch`` hands the
step over, ``collect`` waits for its logits.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch

from engine import dense_deep_gemm, mla_decode_flashmla, moe_deep_gemm
from engine.attention_ops import warm_cudnn_buckets
from engine.config import ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.engine_config import EngineConfig
from engine.kv_cache import BlockSpace, KVCache, bytes_per_block
from engine.layers import Router
from engine.mla import DECODE_KERNEL
from engine.mla_decode import HAS_TRITON
from engine.model import DeepseekForCausalLM
from engine.model_runner import ModelRunner, StepLogits
from engine.overlap import Feed
from engine.parallel.expert_parallel import ExpertGroup, ExpertShard, GatherReduce
from engine.parallel.grid import ParallelConfig
from engine.parallel.kv_layout import RankBlocks, kv_ownership
from engine.scheduler import Scheduled
from engine.speculative import DraftsInFlight
from engine.weights import build_empty_model, init_random_weights, load_weights, share_mtp_tables

log = logging.getLogger(__name__)


class Executor(Protocol):
    allocator: BlockSpace
    block_size: int

    def launch(self, scheduled: list[Scheduled]) -> None: ...

    def collect(self) -> list[StepLogits | None]: ...

    def ownership(self, block_ids: list[int]) -> list[RankBlocks]: ...

    def draft(self, next_ids: list[int], picks: list[int], extra: list[int],
              tables: list[list[int]]) -> list[list[int]]: ...  # speculative decoding (engine.speculative)

    def read_blocks(self, pcp: int, pp: int, physical: list[int]) -> dict[int, torch.Tensor]: ...

    def shutdown(self) -> None: ...


def kv_blocks_for_memory(
    config: EngineConfig, mc: ModelConfig, max_model_len: int, device: torch.device, num_layers: int,
) -> int:
    """KV blocks to allocate on one device holding ``num_layers`` layers (after the weights are loaded)."""
    per_block = bytes_per_block(config.kv_format(mc), config.block_size, num_layers)
    needed_min = -(-max_model_len // config.block_size)
    full = needed_min * config.max_num_seqs  # every slot filled to max_model_len: never more useful
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if device.type == "cuda":
        # gpu_memory_utilization is this engine's share of the device (as vLLM's): its weights, cache and
        # workspace, whatever other processes use, so two nodes can share a GPU on purpose; never more
        # than is free now.
        free, total = torch.cuda.mem_get_info(device)
        workspace = 2 * 2**30  # activations, graphs' pools
        budget = total * config.gpu_memory_utilization - torch.cuda.memory_reserved(device) - workspace
        return min(full, int(max(0, min(budget, free - workspace)) // per_block))
    return min(full, int(config.cpu_kv_cache_gb * 2**30 // per_block))


def check_kv_capacity(num_blocks: int, block_size: int, max_model_len: int, needed: int | None = None) -> None:
    """Fail clearly when a rank's cache cannot hold its part of one request of ``max_model_len``
    (``needed`` blocks; default: the whole request)."""
    needed = -(-max_model_len // block_size) if needed is None else needed
    if num_blocks < needed:
        raise ValueError(
            f"KV cache of {num_blocks} blocks of {block_size} tokens per rank cannot hold one request of "
            f"max_model_len {max_model_len} ({needed} blocks on a rank): lower max_model_len or give the cache "
            "more memory"
        )


def step_rows(config: EngineConfig) -> int:
    """The most rows one step multiplies on a rank: the batch budget, which the scheduler fills with several
    requests' chunks (so not bounded by ``max_model_len``); a PCP rank takes its share of the prompt rows, plus at
    most a decode row a sequence."""
    budget = config.max_num_batched_tokens
    return budget if config.pcp == 1 else min(budget, -(-budget // config.pcp) + config.max_num_seqs)


def load_model(
    config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device, layers: range | None = None,
    experts: ExpertShard | None = None,
) -> DeepseekForCausalLM:
    """``experts``: the routed experts this rank holds (expert parallelism; default all). With
    ``speculative_config`` the model's multi-token prediction layer too."""
    t0 = time.perf_counter()
    model = build_empty_model(mc, dtype, device, layers, config.kv_format(mc), experts,
                              mtp=config.speculative is not None)
    if config.load_format == "dummy":
        init_random_weights(model, config.seed)
    else:
        load_weights(model, config.model)
    log.info("loaded %s in %.1fs", config.model, time.perf_counter() - t0)
    if shared := share_mtp_tables(model):
        log.info("the MTP layer's embedding and head hold the model's own: %d tables held once", shared)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the copies' memory back to the device: the KV cache is sized next
    if dtype == torch.bfloat16 and (routers := sum(m.hold_bf16() for m in model.modules() if isinstance(m, Router))):
        log.info("%d routers' weights are bf16 values: held in bf16, their logits from bf16 GEMMs in fp32", routers)
    if mc.quantization is not None and (held := dense_deep_gemm.hold_fp8_copies(model, mc.quantization.ue8m0,
                                                                                 step_rows(config))):
        log.info("%d dense linears hold an FP8 copy for prefill steps of %d+ rows (DeepGEMM)", held,
                 dense_deep_gemm.MIN_ROWS)
    return model


class LocalExecutor:
    """The whole model and its cache in this process, on one device; with ``ep``, only this member's share of
    the routed experts, every MoE layer dispatching over the EP group (``ExpertGroup``)."""

    def __init__(self, config: EngineConfig, mc: ModelConfig, max_model_len: int,
                 ep: ExpertGroup | None = None) -> None:
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(mc.torch_dtype)
        # On a GPU too: the host's tensor work (batches, sampling) is small (see EngineConfig.cpu_threads).
        torch.set_num_threads(config.cpu_threads)
        self.num_layers = mc.num_hidden_layers
        self.ep = ep
        self.model = load_model(config, mc, self.dtype, self.device, experts=ep.shard if ep else None)
        if ep is not None:
            self.model.attach_expert_comm(GatherReduce(ep.group, ep.shard.rank))
        # Speculative decoding: the MTP layer's KV beside the stack's, one more cache layer (index num_layers).
        self.cache_layers = cache_layers = self.num_layers + (1 if config.speculative is not None else 0)
        n = kv_blocks_for_memory(config, mc, max_model_len, self.device, cache_layers)
        check_kv_capacity(n, config.block_size, max_model_len)
        warm_prefill_kernels(config, mc, self.model, max_model_len, self.dtype, self.device)
        # Under EP every member captures the same graphs in lockstep (collective: engine.cuda_graphs), and
        # replays one size per step with the others.
        graphs = self.device.type == "cuda" and not config.enforce_eager and HAS_TRITON
        kv_format = config.kv_format(mc)
        self.cache = KVCache(kv_format, range(cache_layers), n, config.block_size, self.device,
                             spare_blocks=1 if graphs else 0)
        if HAS_TRITON and DECODE_KERNEL == "triton" and (kernel := mla_decode_flashmla.decode_kernel(
                kv_format, config.block_size, self.dtype, self.device)):
            log.info("decode attention over the fp8 KV cache: %s", kernel)
        self.graphs: DecodeGraphs | None = None
        if graphs:
            self.graphs = DecodeGraphs(self.model, self.cache, n, max_model_len, config.max_num_seqs,
                                       config.max_cudagraph_capture_size, ep)
            self.graphs.capture()
        spec = config.speculative
        self.runner = ModelRunner(self.model, self.cache, self.device, self.graphs, ep,
                                  spec.num_speculative_tokens if spec is not None else 1)
        if graphs and spec is not None:
            self.runner.attach_mtp_graphs()
        self.allocator: BlockSpace = self.cache.allocator
        self.block_size = config.block_size
        self._pending: list[StepLogits | None] | None = None

    def launch(self, scheduled: list[Scheduled], feed: Feed | None = None) -> None:
        # In process the step runs now, while the requests' block tables are as scheduled (under EP every member
        # of the group launches every step, rows or none: ModelRunner.run).
        self._pending = self.runner.run(scheduled, feed)

    def collect(self) -> list[StepLogits | None]:
        assert self._pending is not None, "collect() without launch()"
        out, self._pending = self._pending, None
        return out

    def draft(self, next_ids: list[int], picks: list[int], extra: list[int],
              tables: list[list[int]]) -> list[list[int]]:
        """Speculative decoding's drafts after the last step (``ModelRunner.draft``; under EP every member calls
        it after every step, rows or none)."""
        return self.runner.draft(next_ids, picks, extra, tables)

    def draft_ahead(self, next_ids: list[int], picks: list[int], extra: list[int],
                    tables: list[list[int]]) -> DraftsInFlight:
        """``draft``'s drafts left on the device for the next step (``ModelRunner.draft_ahead``)."""
        return self.runner.draft_ahead(next_ids, picks, extra, tables)

    def ownership(self, block_ids: list[int]) -> list[RankBlocks]:
        return kv_ownership(block_ids, ParallelConfig(), 0, self.num_layers, self.cache_layers - self.num_layers)

    def read_blocks(self, pcp: int, pp: int, physical: list[int]) -> dict[int, torch.Tensor]:
        ids = torch.tensor(physical, dtype=torch.long, device=self.device)
        return {i: t[ids].cpu() for i, t in self.cache.layers.items()}

    def shutdown(self) -> None:
        pass


def warm_prefill_kernels(config: EngineConfig, mc: ModelConfig, model: torch.nn.Module, max_model_len: int,
                         dtype: torch.dtype, device: torch.device) -> None:
    """Build what prefill steps would otherwise build on first use, before serving, so no request pays for it:
    cuDNN's plans for the prompt attention's length buckets (a no-op unless ``attention_ops.CUDNN_BUCKET`` is
    set) and DeepGEMM's kernels for the block-FP8 experts and dense linears (``moe_deep_gemm.warm_up``,
    ``dense_deep_gemm.warm_up``; no-ops where those paths are not taken): the GEMMs' up to ``step_rows``, the
    attention's up to a prompt's longest chunk."""
    rows, gemm_rows = min(config.max_num_batched_tokens, max_model_len), step_rows(config)
    t0 = time.perf_counter()
    planned = warm_cudnn_buckets(mc.num_attention_heads, mc.qk_head_dim, mc.v_head_dim, rows, dtype, device)
    if planned:
        log.info("planned cuDNN attention for %d prompt-length buckets in %.1fs", planned, time.perf_counter() - t0)
    t0 = time.perf_counter()
    if warmed := moe_deep_gemm.warm_up(model, gemm_rows):
        log.info("compiled DeepGEMM's FP8 experts for %d prefill sizes in %.1fs", warmed, time.perf_counter() - t0)
    t0 = time.perf_counter()
    if warmed := dense_deep_gemm.warm_up(model, gemm_rows):
        log.info("compiled DeepGEMM's FP8 dense linears for %d shapes x sizes in %.1fs", warmed,
                 time.perf_counter() - t0)
