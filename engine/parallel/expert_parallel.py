"""Expert parallelism (``enable_expert_parallel``): each rank of an EP group holds a contiguous range of the
routed experts, and every MoE layer dispatches its tokens to them and combines the results.

Dispatch and combine ("AgRs", vLLM's all-gather / reduce-scatter): each rank routes its own tokens (top-k
ids and weights), the group all-gathers hidden states, ids and weights with per-rank row counts known in
advance (no sizes exchanged), each rank runs its local experts on every gathered (token, choice) that
chose one of them, and the weighted sums are reduced back to each token's owner. Attention, norms, dense
layers and shared experts stay replicated.

``ExpertComm`` is the one seam: this all-gather one moves every token to every rank; an all-to-all
backend (DeepEP-style, each token only to its experts' owners) implements the same two calls.

On a prefill node an EP group is every DP × PCP rank of one PP stage (``ep_rank = dp·PCP + pcp``,
``grid.ParallelConfig``). Within a replica the PCP ranks step together anyway; across DP replicas
(``spans_dp``) the replicas step in lockstep: while any has work, every one runs a step, an idle one with no
rows (the collectives only; ``LLMEngine.lockstep``), and each step's rows per EP rank are all-gathered once
(``exchange_counts``) for every MoE layer of that step. The last stage's MTP layer (speculative decoding) runs
over the step's rows with the step's counts; across DP replicas every replica's ranks run it after every step,
asked for before any answer is awaited (``LLMEngine.settle_drafts``).

On a decode node the EP group is its DP replicas, each a whole engine in a process of its own
(``ExpertGroup``): nobody drives them, so each step they agree whether any has work (``ExpertGroup.busy``)
and exchange their rows (``ExpertGroup.counts``, with whether each can replay the step as a CUDA graph:
``engine.cuda_graphs``), as vLLM's DP engines all-reduce their unfinished flags and token counts each step;
the waves that ``busy`` ends are started and joined in ``decode_node.replica``. With speculative decoding the
MTP layer's MoE dispatches over the same group: after each step with rows anywhere every member runs the
layer's passes (``ModelRunner.draft``), their rows exchanged once (``ExpertGroup.pass_counts``), a member
without rows in a pass running its MoE's collectives only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.parallel.collectives import gather_padded


@dataclass(frozen=True)
class ExpertShard:
    """Which routed experts one EP rank holds: ``[start, stop)`` of ``num_experts``."""

    rank: int
    size: int
    num_experts: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"EP rank {self.rank} outside a group of {self.size}")
        if self.num_experts % self.size:
            raise ValueError(f"enable_expert_parallel: {self.num_experts} routed experts do not divide over "
                             f"{self.size} EP ranks (each rank holds a contiguous E / EP)")

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.size

    @property
    def start(self) -> int:
        return self.rank * self.per_rank

    @property
    def stop(self) -> int:
        return self.start + self.per_rank

    def local(self, expert: int) -> int | None:
        """The local index of global ``expert``, or None where another rank holds it."""
        return expert - self.start if self.start <= expert < self.stop else None


def ep_size(config: EngineConfig) -> int:
    """Ranks in each EP group: DP x PCP under ``enable_expert_parallel``, else 1."""
    return config.dp * config.pcp if config.enable_expert_parallel else 1


def spans_dp(config: EngineConfig) -> bool:
    """Whether EP groups span DP replicas, which then step in lockstep."""
    return config.enable_expert_parallel and config.dp > 1


def expert_shard(config: EngineConfig, mc: ModelConfig, rank: int = 0) -> ExpertShard | None:
    """The routed experts rank ``rank`` (of the node's rank grid) holds under ``enable_expert_parallel``
    (None: all of them)."""
    size = ep_size(config)
    if size == 1 or not mc.n_routed_experts:
        return None
    return ExpertShard(config.parallel().ep_rank(rank), size, mc.n_routed_experts)


def exchange_counts(rows: int, group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
    """Every EP rank's row count this step, in group order, from this rank's ``rows`` (one all-gather)."""
    return exchange_rows([rows], group, device)[0]


def exchange_rows(rows: list[int], group: dist.ProcessGroup | None, device: torch.device) -> list[list[int]]:
    """Every EP rank's row counts in each of several passes (the same number on every rank), from this rank's
    ``rows`` per pass (one all-gather): per pass, the counts in group order."""
    n, p = dist.get_world_size(group), len(rows)
    mine = torch.tensor(rows, dtype=torch.int64, device=device)
    out = torch.empty(n * p, dtype=torch.int64, device=device)
    if dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(out, mine, group=group)
    else:
        dist.all_gather(list(out.chunk(n)), mine, group=group)
    return out.view(n, p).t().tolist()


def further_rows(extra: list[int], k: int) -> list[int]:
    """A member's rows in each further MTP pass of a step (speculative decoding, k drafts at most): pass j (1 to
    k - 1) runs the picks drafting more than j tokens (``extra[i]``: pick i's drafts after its first)."""
    return [sum(e >= j for e in extra) for j in range(1, k)]


def exchange_passes(rows: list[int], group: dist.ProcessGroup | None, device: torch.device) -> list[list[int]]:
    """``exchange_rows`` for a step's MTP passes: the passes up to the last in which any member has rows (a
    member's rows only shrink pass to pass, so the passes dropped are the tail every member skips)."""
    return [counts for counts in exchange_rows(rows, group, device) if any(counts)]


@dataclass
class ExpertGroup:
    """One member of an EP group of in-process engines, one engine per process of a ``torch.distributed``
    world (a decode node's DP replicas): its experts, the group whose collectives move the MoE layers'
    tensors (``group``: NCCL on GPUs, gloo on CPU; None is the world), and a gloo group for the host's
    per-step agreement (``host``; None is the world). Every member calls ``busy`` and, when it says so,
    ``counts`` in every step, in the same order (and ``every`` once per CUDA graph size at start-up); with
    speculative decoding, ``pass_counts`` after every step in which any member had rows."""

    shard: ExpertShard
    group: dist.ProcessGroup | None = None
    host: dist.ProcessGroup | None = None
    rows: int = 0  # every member's rows in the last step, summed

    @classmethod
    def join(cls, num_experts: int) -> ExpertGroup:
        """This process's place in the world's EP group (collective: every member calls it, once)."""
        host = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return cls(ExpertShard(dist.get_rank(), dist.get_world_size(), num_experts), None, host)

    def busy(self, mine: bool) -> bool:
        """Whether any member has work (one all-reduce): if so every member steps, else none does."""
        flag = torch.tensor([int(mine)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.host)
        return bool(flag.item())

    def every(self, mine: bool) -> bool:
        """Whether every member says so (one all-reduce)."""
        flag = torch.tensor([int(mine)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.host)
        return bool(flag.item())

    def counts(self, rows: int, replayable: bool = False) -> tuple[list[int], bool]:
        """Every member's rows this step, in group order (the MoE layers' dispatch sizes), and whether every
        member can run the step as a CUDA graph's replay (``replayable`` here; ``engine.model_runner``): one
        all-gather."""
        n = dist.get_world_size(self.host)
        mine = torch.tensor([rows, int(replayable)], dtype=torch.int64)
        out = torch.empty(2 * n, dtype=torch.int64)
        dist.all_gather(list(out.chunk(n)), mine, group=self.host)
        counts, replay = out.view(n, 2).t().tolist()
        self.rows = sum(counts)
        return counts, all(replay)

    def pass_counts(self, rows: list[int]) -> list[list[int]]:
        """Every member's rows in each of a step's MTP passes (speculative decoding: ``ModelRunner.draft``),
        from this member's ``rows`` per pass (the same number of passes on every member): per pass that any
        member runs, the counts in group order (one all-gather: ``exchange_passes``)."""
        return exchange_passes(rows, self.host, torch.device("cpu"))


class ExpertComm(Protocol):
    """How an MoE layer's tokens reach the experts' owners and their results come back."""

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, counts: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's rows (hidden [T, D], top-k ids and weights [T, K]; rank i has counts[i] rows) ->
        the rows this rank computes for (its experts' share of them is its business)."""
        ...

    def combine(self, out: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Per dispatched row, this rank's partial sums -> this rank's rows' full sums [T, D]."""
        ...


class GatherReduce:
    """AgRs over a process group: all-gather every rank's rows (padded to the largest count), reduce the
    partial sums back (NCCL: reduce-scatter; gloo has none: all-reduce, then this rank's rows)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int) -> None:
        self.group = group
        self.rank = rank

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, counts: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (gather_padded(x, counts, self.group), gather_padded(ids, counts, self.group),
                gather_padded(weights, counts, self.group))

    def combine(self, out: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if len(counts) == 1:
            return out
        m = max(counts)
        if m == 0:  # no rows anywhere this step (every replica idle, or waiting for blocks)
            return out[:0]
        if dist.get_backend(self.group) == "nccl":
            part = out.new_empty((m, *out.shape[1:]))
            dist.reduce_scatter_tensor(part, out.contiguous(), group=self.group)
            return part[: counts[self.rank]]
        dist.all_reduce(out, group=self.group)
        return out[self.rank * m : self.rank * m + counts[self.rank]]


@dataclass
class ExpertParallel:
    """One MoE layer's place in its EP group: its shard, and the group's comm once the group exists."""

    shard: ExpertShard
    comm: ExpertComm | None = None

    def expert_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Of gathered top-k ``ids`` [N, K]: the flat (row * K + choice) positions that chose a local expert,
        and those choices' local expert ids."""
        flat = ids.flatten()
        pos = ((flat >= self.shard.start) & (flat < self.shard.stop)).nonzero().squeeze(1)
        return pos, flat[pos] - self.shard.start

    def local_choices(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Of gathered top-k ``ids`` [N, K], in their shape (a CUDA graph's): each choice's local expert id,
        ``per_rank`` (past the local ones) where another rank holds it, and which choices are local [N, K]."""
        mine = (ids >= self.shard.start) & (ids < self.shard.stop)
        return torch.where(mine, ids - self.shard.start, self.shard.per_rank), mine
