"""The body of one rank process: its PP stage's layers, its KV cache, and the step loop.

The protocol with the driver is in ``rank_messages.py``. With a ``CacheExporter`` (the node's KV
transport), the rank registers its cache through it and hands the answer to the driver.

With ``speculative_config`` the last PP stage also holds the multi-token prediction (MTP) layer and its
KV cache layer (index ``num_hidden_layers``, after the stage's own). After each step its PCP ranks run the
layer over their own rows of that step (``RunDraft``: the step's batch and final hidden states, kept until
then), through the same PCP attention as the stack's layers, so its KV is sharded (or replicated) exactly
as theirs; the rank that computed a row the driver picks has that row's draft, and PCP rank 0 answers. Further
drafts (k > 1) are passes of decode rows, one a drafting request, run on every PCP rank alike.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine import envs
from engine.cache_export import CacheExporter
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.executor import kv_blocks_for_memory, load_model, warm_prefill_kernels
from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVCache
from engine.model import MTPLayer
from engine.parallel.collectives import gather_padded
from engine.parallel.expert_parallel import (
    GatherReduce,
    exchange_counts,
    exchange_passes,
    expert_shard,
    further_rows,
    spans_dp,
)
from engine.parallel.grid import ParallelConfig, stage_layers
from engine.parallel.rank_group import RankContext
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
    Stop,
)
from engine.parallel.step_plan import PlanRow, StepPlan, build_rank_batch, int_tensor


@dataclass(frozen=True)
class RankSpec:
    config: EngineConfig
    max_model_len: int
    exporter: CacheExporter | None = None  # registers the rank's cache with the node's KV transport


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    dev = config.torch_device()
    if dev.type == "cuda":
        return torch.device("cuda", config.gpu_ids(config.parallel().world_size)[rank])
    return dev


class RankWorker:
    def __init__(self, spec: RankSpec, rank: int) -> None:
        cfg = spec.config
        self.config = cfg
        self.par: ParallelConfig = cfg.parallel()
        self.coord = self.par.coord(rank)
        self.device = rank_device(cfg, rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # Host-side tensor work (step plans) is small: a big OpenMP pool only adds wake-up latency.
        torch.set_num_threads(cfg.cpu_threads)
        self.mc = ModelConfig.from_pretrained(cfg.model)
        self.dtype = cfg.torch_dtype(self.mc.torch_dtype)
        self.layers = stage_layers(self.mc.num_hidden_layers, self.par.pp, self.coord.pp)
        self.experts = expert_shard(cfg, self.mc, rank)
        self.model = load_model(cfg, self.mc, self.dtype, self.device, self.layers, self.experts)
        # Speculative decoding: the last stage's MTP layer has a cache layer after the stage's own.
        mtp = 1 if self.model.mtp is not None else 0
        self.cache_layers = range(self.layers.start, self.layers.stop + mtp)
        # The last step's plan, batch and hidden states [T, D]: what its MTP pass (``draft``) runs on.
        self._last: tuple[StepPlan, ForwardBatch, torch.Tensor] | None = None
        self.max_model_len = spec.max_model_len
        # Every rank creates every PCP group, in the same order (new_group is collective).
        self.pcp_group: dist.ProcessGroup | None = None
        for ranks in self.par.all_pcp_groups():
            g = dist.new_group(ranks)
            if rank in ranks:
                self.pcp_group = g
        # The EP group: this rank's PCP group, or with DP replicas every DP x PCP rank of its stage (every
        # rank creates every EP group, in the same order); then the replicas step in lockstep and each
        # step's rows per EP rank are exchanged once.
        self.ep_group: dist.ProcessGroup | None = None
        if self.experts is not None and spans_dp(cfg):
            for ranks in self.par.all_ep_groups():
                g = dist.new_group(ranks)
                if rank in ranks:
                    self.ep_group = g
        if self.experts is not None:
            ep_group = self.ep_group if self.ep_group is not None else self.pcp_group
            self.model.attach_expert_comm(GatherReduce(ep_group, self.experts.rank))
        stages = self.par.pp_group(rank)
        pp = self.coord.pp
        self.prev_rank = stages[pp - 1] if pp > 0 else None
        self.next_rank = stages[pp + 1] if pp + 1 < len(stages) else None
        self.reports = self.next_rank is None and self.coord.pcp == 0
        self.cache: KVCache | None = None
        self.exporter = spec.exporter
        self.rank = rank
        self.timing = envs.step_timing()
        self.profile_step = envs.profile_step()
        self.steps = 0
        self._t = 0.0

    def capacity_blocks(self) -> int:
        return kv_blocks_for_memory(
            self.config, self.mc, self.max_model_len, self.device, len(self.cache_layers)
        )

    def init_cache(self, num_blocks: int) -> object:
        """Allocate the cache; with an exporter, register it and return its answer for the driver."""
        warm_prefill_kernels(self.config, self.mc, self.model, self.max_model_len, self.dtype, self.device)
        self.cache = KVCache(self.config.kv_format(self.mc), self.cache_layers, num_blocks, self.config.block_size,
                             self.device)
        return self.exporter.export(self.cache.layers) if self.exporter is not None else None

    def close(self) -> None:
        """Unregister the cache; a failure here is logged, so it never hides the rank's own error."""
        if self.exporter is not None and self.cache is not None:
            try:
                self.exporter.close()
            except Exception as e:
                print(f"rank {self.rank}: closing the cache exporter failed: {e}", file=sys.stderr, flush=True)

    def _mark(self, what: str) -> None:
        """With PDCLUSTER_STEP_TIMING=1, print how long each phase of a step took (synchronising)."""
        if not self.timing:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if what != "start":
            print(f"rank {self.rank}: {what} {1e3 * (now - self._t):.1f} ms", file=sys.stderr, flush=True)
        self._t = now

    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run one step; with PDCLUSTER_PROFILE_STEP=N, rank 0 prints a torch.profiler table of step N."""
        self.steps += 1
        if self.rank != 0 or self.profile_step != self.steps:
            return self._execute(plan)
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            out = self._execute(plan)
        key = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60), file=sys.stderr)
        trace_dir = envs.profile_trace_dir()
        if trace_dir:
            prof.export_chrome_trace(os.path.join(trace_dir, f"rank0-step{self.steps}.json"))
        return out

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> torch.Tensor | None:
        assert self.cache is not None
        self._last = None
        self._mark("start")
        batch = build_rank_batch(plan, self.par, self.coord.pcp, self.cache.block_size, self.device, self.pcp_group)
        if self.experts is not None:  # the MoE layers' dispatch sizes, once for all of them
            st = batch.pcp
            assert st is not None
            # Within a replica the plan says every PCP rank's rows; the other replicas' are exchanged.
            batch.ep_counts = (st.row_counts if self.ep_group is None
                               else exchange_counts(st.row_counts[self.coord.pcp], self.ep_group, self.device))
        self._mark("plan")
        n = batch.num_tokens
        hidden = None
        if self.prev_rank is not None:
            hidden = torch.empty(n, self.mc.hidden_size, dtype=self.dtype, device=self.device)
            if n:
                dist.recv(hidden, src=self.prev_rank)
            self._mark("recv")
        hidden = self.model(batch, self.cache.layers, hidden)
        self._mark("layers")
        if self.next_rank is not None:
            if n:
                dist.send(hidden.contiguous(), dst=self.next_rank)
            return None
        if self.model.mtp is not None:
            self._last = (plan, batch, hidden)  # for the MTP layer's pass (``draft``), which follows
        st = batch.pcp
        assert st is not None and st.logits_index is not None
        rows = gather_padded(hidden[batch.logits_rows], st.logits_counts, self.pcp_group)[st.logits_index]
        if not self.reports or rows.shape[0] == 0:
            return None
        return self.model.compute_logits(rows).cpu()

    @torch.inference_mode()
    def draft(self, next_ids: torch.Tensor, picks: list[int], extra: list[int] | None = None,
              tables: list[list[int]] | None = None) -> list[list[int]]:
        """The MTP layer over this rank's rows of the last step, each row with the stack's hidden state there
        and ``next_ids`` [the step's rows, flattened in plan order] at its plan row, its KV written where the
        step's went; returns the drafts at the plan rows ``picks`` (``[]`` when none), agreed over the PCP
        group: each pick from the rank that computed its row (a decode row: every rank, alike). Under expert
        parallelism the layer's MoE dispatches with the step's counts (``batch.ep_counts``), its rows being the
        step's; across DP replicas every replica's last-stage ranks run it after every lockstep step (the driver
        asks them all before it awaits any answer: ``ReplicaExecutor.launch_draft``).

        ``extra[i]`` further drafts for pick i (k > 1, ``ModelRunner.draft``'s): pass j runs the layer once more
        for the picks drafting that far, one row each at the pick's position + j with its last draft and the
        layer's own hidden state there, as a step's decode rows (on every PCP rank alike, attending the layer's
        sharded cache through the PCP attention); ``tables[i]`` (global block ids) covers those positions. The
        picks' hidden states go to every rank first, from the rank that computed each. Across DP replicas with EP
        every replica's ranks run the same passes, each rank's rows in them exchanged first (``_further_counts``)."""
        assert self.model.mtp is not None and self.model.rope is not None and self.cache is not None
        assert self._last is not None, "RunDraft without a step before it"
        plan, batch, hidden = self._last
        self._last = None
        st = batch.pcp
        assert st is not None
        index, layer = next(iter(self.model.mtp.items()))  # DeepSeek's one layer (as ModelRunner.draft)
        assert isinstance(layer, MTPLayer)
        cache = self.cache.layers[int(index)]
        mine = st.plan_rows()  # [local rows] their plan rows
        h = layer.predict(next_ids[mine].to(self.device), hidden, batch, cache, self.model.rope)
        passes = self._further_counts(extra or [])
        if not picks:
            for counts in passes or []:  # other replicas' requests draft further
                layer.expert_collectives(counts)
            return []
        where = torch.full((next_ids.numel(),), -1, dtype=torch.long)
        where[mine] = torch.arange(mine.numel())
        local = where[torch.tensor(picks, dtype=torch.long)]  # [picks] the local row, or -1: another rank's
        have = torch.nonzero(local >= 0).flatten()
        tokens = torch.full((len(picks),), -1, dtype=torch.long, device=self.device)
        if have.numel():
            rows = local[have].to(self.device)
            tokens[have.to(self.device)] = layer.compute_logits(h[rows]).argmax(-1)
        if self.par.pcp > 1:
            dist.all_reduce(tokens, op=dist.ReduceOp.MAX, group=self.pcp_group)
        drafts = [[t] for t in tokens.tolist()]
        extra = extra or [0] * len(picks)
        further = len(passes) if passes is not None else max(extra)
        if not further:
            return drafts
        assert len(extra) == len(picks) and (tables is not None and len(tables) == len(picks) or not any(extra))
        hp = self._pick_states(h, local, have) if any(extra) else h[:0]  # (none: other replicas' passes only)
        starts = torch.cat([r.start + torch.arange(r.num_new) for r in plan.rows])  # each plan row's position
        pos = starts[torch.tensor(picks, dtype=torch.long)].tolist()
        live = list(range(len(picks)))
        for j in range(1, further + 1):
            keep = [n for n, i in enumerate(live) if extra[i] >= j]
            live = [live[n] for n in keep]
            if not live:  # (EP across DP replicas: another replica's requests draft this far)
                assert passes is not None
                layer.expert_collectives(passes[j - 1])
                continue
            assert tables is not None
            sel = torch.tensor(keep, dtype=torch.long, device=self.device)
            tokens, hp = tokens[sel], hp[sel]
            step = StepPlan([PlanRow(int_tensor([drafts[i][-1]]), pos[i] + j, tables[i], None) for i in live])
            rows_batch = build_rank_batch(step, self.par, self.coord.pcp, self.cache.block_size, self.device,
                                          self.pcp_group)
            if self.experts is not None:  # each PCP rank runs every row: over PCP ranks, these are the counts
                assert rows_batch.pcp is not None
                rows_batch.ep_counts = passes[j - 1] if passes is not None else rows_batch.pcp.row_counts
            hp = layer.predict(tokens, hp, rows_batch, cache, self.model.rope)
            tokens = layer.compute_logits(hp).argmax(-1)  # alike on every rank: the rows are decode rows
            for i, t in zip(live, tokens.tolist()):
                drafts[i].append(t)
        return drafts

    def _further_counts(self, extra: list[int]) -> list[list[int]] | None:
        """Across DP replicas with EP (``ep_group``), every EP rank's rows in each further MTP pass (k > 1), from
        this rank's picks' ``extra`` (none: a replica without drafting requests): one all-gather of each rank's
        rows per pass for the k - 1 passes, every rank of the group alike, then the passes up to the last any rank
        has rows in (a rank's rows only shrink pass to pass). None elsewhere: the replica's ranks run the passes
        its own picks need, together."""
        spec = self.config.speculative
        if self.ep_group is None or spec is None or spec.num_speculative_tokens == 1:
            return None
        return exchange_passes(further_rows(extra, spec.num_speculative_tokens), self.ep_group, self.device)

    def _pick_states(self, h: torch.Tensor, local: torch.Tensor, have: torch.Tensor) -> torch.Tensor:
        """[picks, D] the MTP layer's output at each pick's row on every PCP rank: from the lowest rank that
        computed the row (a decode row is on every rank), zeros elsewhere, summed over the group."""
        out = torch.zeros(local.numel(), h.shape[-1], dtype=h.dtype, device=self.device)
        if have.numel():
            out[have.to(self.device)] = h[local[have].to(self.device)]
        if self.par.pcp == 1:
            return out
        owner = torch.where(local >= 0, self.coord.pcp, self.par.pcp).to(self.device)
        dist.all_reduce(owner, op=dist.ReduceOp.MIN, group=self.pcp_group)
        out[owner != self.coord.pcp] = 0
        dist.all_reduce(out, group=self.pcp_group)
        return out

    def read_blocks(self, physical: list[int]) -> dict[int, torch.Tensor]:
        assert self.cache is not None
        ids = torch.tensor(physical, dtype=torch.long, device=self.device)
        return {i: t[ids].cpu() for i, t in self.cache.layers.items()}


def serve_rank(ctx: RankContext) -> None:
    """RankGroup target: load, size the cache with the driver, then serve steps until ``Stop``."""
    worker = RankWorker(ctx.payload, ctx.rank)
    ctx.conn.send(Loaded(worker.capacity_blocks(), worker.model.routed_expert_params()))
    msg = ctx.conn.recv()
    if isinstance(msg, Stop):
        return
    if not isinstance(msg, SizeCache):
        raise ValueError(f"rank {ctx.rank}: expected SizeCache, got {msg!r}")
    try:
        ctx.conn.send(CacheReady(ctx.rank, worker.init_cache(msg.num_blocks)))
        while True:
            match ctx.conn.recv():
                case Stop():
                    return
                case RunStep(plan):
                    out = worker.execute(plan)
                    if worker.reports:
                        ctx.conn.send(StepOutput(out))
                case RunDraft(next_ids, picks, extra, tables):
                    drafts = worker.draft(next_ids, picks, extra, tables)
                    if worker.reports and picks:
                        ctx.conn.send(Drafted(drafts))
                case ReadBlocks(physical):
                    ctx.conn.send(Blocks(worker.read_blocks(physical)))
                case other:
                    raise ValueError(f"rank {ctx.rank}: unknown message {other!r}")
    finally:
        worker.close()
