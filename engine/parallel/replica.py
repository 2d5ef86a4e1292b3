"""Driver side of a parallel node: the DP × PCP × PP rank processes and one executor per DP replica.

The driver schedules and samples; ranks only compute. Each step the replica's executor sends the
same plan (request rows, global block tables, which rows need logits) to every rank of the replica,
and the last PP stage's PCP rank 0 returns the logits in plan order. Sampled tokens come back into
the next plan, so every stage sees the global batch's tokens. DP replicas are independent: the
driver launches a step on each before collecting any, so they compute concurrently.

With ``speculative_config`` the last stage holds the multi-token prediction layer (``rank_worker``): after
a step's logits the executor's ``draft`` has that stage's PCP ranks run it over the step's rows, and the
ownership query counts its cache layer on that stage, so a KV transfer moves it with the rest. Under expert
parallelism across DP replicas the layer's MoE dispatches over every replica's last-stage ranks, so the drafts
are asked for in two halves (``launch_draft`` as each replica's step finishes, ``collect_drafts`` once all
are: ``LLMEngine.settle_drafts``).
"""

from __future__ import annotations

import logging
from typing import TypeVar

import torch

from engine.cache_export import CacheExporter
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.executor import check_kv_capacity
from engine.kv_cache import BlockAllocator, BlockSpace
from engine.model_runner import StepLogits, logits_span
from engine.parallel.grid import ParallelConfig
from engine.parallel.kv_layout import RankBlocks, ShardedBlockAllocator, kv_ownership, max_blocks_per_rank
from engine.parallel.rank_group import STARTUP_MIN_S, RankFailure, RankGroup
from engine.parallel.rank_messages import (
    Blocks,
    CacheReady,
    Drafted,
    Loaded,
    ReadBlocks,
    RunDraft,
    RunStep,
    SizeCache,
    StepOutput,
)
from engine.parallel.rank_worker import RankSpec, serve_rank
from engine.parallel.step_plan import PlanRow, StepPlan, int_tensor, local_token_counts
from engine.scheduler import Scheduled

log = logging.getLogger(__name__)
M = TypeVar("M")


class ParallelNode:
    """Starts every rank of the node, sizes the KV cache (the minimum any rank can hold), and stops them."""

    def __init__(self, config: EngineConfig, max_model_len: int, exporter: CacheExporter | None = None) -> None:
        self.config = config
        self.par: ParallelConfig = config.parallel()
        self.num_layers = ModelConfig.from_pretrained(config.model).num_hidden_layers
        # Speculative decoding: the MTP layer's cache layer, on the last stage after its own.
        self.mtp_layers = 1 if config.speculative is not None else 0
        if self.par.pp > self.num_layers:
            raise ValueError(f"pp={self.par.pp} exceeds the model's {self.num_layers} layers")
        ws = self.par.world_size
        on_gpu = config.torch_device().type == "cuda"
        gpus = config.gpu_ids(ws) if on_gpu else None
        if gpus is not None and max(gpus) >= torch.cuda.device_count():
            raise ValueError(f"dp x pcp x pp = {ws} ranks need GPUs {gpus} (one each, from "
                             f"{'gpus ' + str(config.gpus) if config.gpus else 'device ' + config.device}); "
                             f"{torch.cuda.device_count()} visible")
        backend = "nccl" if on_gpu else "gloo"
        self.group = RankGroup(
            serve_rank, ws, [RankSpec(config, max_model_len, exporter)] * ws, backend=backend,
            host=config.dist_host, port=config.dist_port, collective_timeout_s=config.rank_timeout_s, gpus=gpus,
        )
        t = max(config.rank_timeout_s, STARTUP_MIN_S)
        self.group.start(ready_timeout_s=t)
        try:
            loaded = [self._expect(r, Loaded, t) for r in range(ws)]
            self.expert_params = [m.expert_params for m in loaded]  # per rank
            self.num_blocks = int(min(m.capacity_blocks for m in loaded))
            bs = config.block_size
            need = None  # replicated: every rank holds the whole request
            if self.par.kv_layout == "sharded":  # the busiest rank's share (interleave runs can be uneven)
                need = max_blocks_per_rank(max_model_len, bs, self.par.pcp, self.par.interleave(bs))
            check_kv_capacity(self.num_blocks, bs, max_model_len, need)
            self.group.broadcast(SizeCache(self.num_blocks))
            # What the exporter answered for each rank's cache (None without one).
            self.cache_exports = {r: self._expect(r, CacheReady, t).export for r in range(ws)}
        except BaseException:
            self.group.shutdown()
            raise
        log.info("%d ranks up (dp=%d pcp=%d pp=%d, %s KV, %d blocks per rank)", ws, self.par.dp,
                 self.par.pcp, self.par.pp, self.par.kv_layout, self.num_blocks)

    def _expect(self, rank: int, kind: type[M], timeout_s: float) -> M:
        msg = self.group.recv(rank, timeout_s)
        if not isinstance(msg, kind):
            self.group.shutdown()
            raise RankFailure(f"rank {rank} sent {str(msg)[:80]}, expected {kind.__name__}")
        return msg

    def replica(self, dp: int) -> ReplicaExecutor:
        return ReplicaExecutor(self, dp)

    def pids(self) -> list[int]:
        return self.group.pids()

    def shutdown(self, why: str = "shut down") -> None:
        self.group.shutdown(why=why)


class ReplicaExecutor:
    """Runs one DP replica's steps on its PCP × PP ranks (see the module docstring)."""

    def __init__(self, node: ParallelNode, dp: int) -> None:
        self.node = node
        self.dp = dp
        par = node.par
        self.par = par
        self.block_size = node.config.block_size
        self.ranks = par.replica_ranks(dp)
        self.reporter = par.rank(dp, par.pp - 1, 0)
        self.last_stage = [par.rank(dp, par.pp - 1, c) for c in range(par.pcp)]  # (the MTP layer's ranks)
        self.allocator: BlockSpace = (
            ShardedBlockAllocator(node.num_blocks, par.pcp, self.block_size, par.interleave(self.block_size))
            if par.kv_layout == "sharded"
            else BlockAllocator(node.num_blocks)
        )
        self._pending: StepPlan | None = None
        self._drafting = 0  # drafts asked for by launch_draft, not yet collected ...
        self._asked = False  # ... and whether the ranks were asked at all (with no picks they answer nothing)
        self.local_counts: list[int] = []  # the last step's rows per PCP rank (DP metadata)

    def _check_answered(self, what: str) -> None:
        if self._asked:  # the last stage's ranks may still be in the MTP pass, whose answer comes first
            raise RuntimeError(f"{what} with the last step's drafts asked for and not collected")

    def launch(self, scheduled: list[Scheduled]) -> None:
        self._check_answered("a step launched")
        plan = StepPlan([
            PlanRow(  # a verify step's rows (speculative decoding): the last token and the drafts, a chunk
                token_ids=int_tensor(s.seq.tokens(s.seq.num_computed, s.seq.num_computed + s.num_new - len(s.drafts))
                                     + s.drafts),
                start=s.seq.num_computed,
                block_ids=list(s.seq.block_ids),
                logits=logits_span(s),
            )
            for s in scheduled
        ])
        self.local_counts = local_token_counts(plan, self.par.pcp)
        for r in self.ranks:
            self.node.group.send(r, RunStep(plan))
        self._pending = plan

    def collect(self) -> list[StepLogits | None]:
        assert self._pending is not None, "collect() without launch()"
        plan, self._pending = self._pending, None
        msg = self.node.group.recv(self.reporter, self.node.config.rank_timeout_s)
        if not isinstance(msg, StepOutput):
            self.node.shutdown()
            raise RankFailure(f"rank {self.reporter} sent {str(msg)[:80]} instead of a step's logits")
        logits = msg.logits
        out: list[StepLogits | None] = []
        pos = 0
        for row in plan.rows:
            if row.logits is None:
                out.append(None)
                continue
            first, k = row.logits
            assert logits is not None
            out.append(StepLogits(first, logits[pos : pos + k]))
            pos += k
        return out

    def draft(self, next_ids: list[int], picks: list[int], extra: list[int],
              tables: list[list[int]]) -> list[list[int]]:
        """Speculative decoding, after a step's ``collect``: the MTP layer over that step's rows on the last
        stage's PCP ranks (``RunDraft``; ``next_ids``: the token after each row, flattened in plan order), the
        draft at each row of ``picks``, and ``extra[i]`` further ones for pick i (k > 1: the ranks run the layer
        again over those, ``tables[i]``, its global block table, covering their positions)."""
        self.launch_draft(next_ids, picks, extra, tables)
        return self.collect_drafts()

    def launch_draft(self, next_ids: list[int], picks: list[int], extra: list[int] | None = None,
                     tables: list[list[int]] | None = None) -> None:
        """``draft``'s first half: the last stage's ranks asked to run the MTP layer (under EP across DP replicas
        every replica's are asked before any answer is awaited: their MoE dispatches over all of them)."""
        further = list(extra) if extra is not None and any(extra) else None
        msg = RunDraft(int_tensor(next_ids), list(picks), further,
                       [list(t) for t in tables] if further is not None and tables is not None else None)
        for r in self.last_stage:
            self.node.group.send(r, msg)
        self._drafting = len(picks)
        self._asked = True

    def collect_drafts(self) -> list[list[int]]:
        """``draft``'s second half: the drafts asked for by ``launch_draft``."""
        n, self._drafting, self._asked = self._drafting, 0, False
        if not n:
            return []
        reply = self.node.group.recv(self.reporter, self.node.config.rank_timeout_s)
        if (not isinstance(reply, Drafted) or len(reply.tokens) != n
                or any(min(d, default=-1) < 0 for d in reply.tokens)):
            self.node.shutdown(why=f"rank {self.reporter} answered a draft with {str(reply)[:80]}")
            raise RankFailure(f"rank {self.reporter} sent {str(reply)[:80]} instead of {n} drafts")
        return [list(d) for d in reply.tokens]

    def ownership(self, block_ids: list[int]) -> list[RankBlocks]:
        return kv_ownership(block_ids, self.par, self.dp, self.node.num_layers, self.node.mtp_layers)

    def read_blocks(self, pcp: int, pp: int, physical: list[int]) -> dict[int, torch.Tensor]:
        if self._pending is not None:
            raise RuntimeError("cannot read KV blocks while a step is running on the replica")
        self._check_answered("KV blocks read")
        rank = self.par.rank(self.dp, pp, pcp)
        self.node.group.send(rank, ReadBlocks(physical))
        msg = self.node.group.recv(rank, self.node.config.rank_timeout_s)
        if not isinstance(msg, Blocks):
            self.node.shutdown(why=f"rank {rank} answered a block read with {str(msg)[:80]}")
            raise RankFailure(f"rank {rank} sent {str(msg)[:80]!r} instead of KV blocks")
        return msg.layers

    def shutdown(self) -> None:
        self.node.shutdown()
