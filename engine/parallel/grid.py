"""The rank grid of one prefill node, in vLLM's order: ``rank = ((dp * PP + pp) * PCP + pcp) * TP + tp``.

Groups: a PCP group is the ranks with the same (dp, pp, tp); a PP group the same (dp, pcp, tp);
a DP replica is the PCP × PP × TP ranks with the same dp; an EP group (expert parallelism) every DP × PCP
rank of one PP stage (the same (pp, tp)), DP-major: ``ep_rank = dp * PCP + pcp`` (vLLM's flattening).
"""

from __future__ import annotations

from dataclasses import dataclass

KV_LAYOUTS = ("sharded", "replicated")


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1
    pcp: int = 1
    pp: int = 1
    tp: int = 1
    kv_layout: str = "sharded"
    # Tokens per contiguous run on one PCP rank in the sharded layout; a multiple of the block size.
    kv_interleave: int | None = None  # None = one block

    def __post_init__(self) -> None:
        for name in ("dp", "pcp", "pp", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tp != 1:
            raise ValueError("tp > 1 is not supported yet (MLA attention is replicated across TP anyway)")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if self.kv_interleave is not None and self.kv_interleave < 1:
            raise ValueError(f"kv_interleave must be >= 1, got {self.kv_interleave}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.pcp * self.tp

    def rank(self, dp: int, pp: int, pcp: int, tp: int = 0) -> int:
        return ((dp * self.pp + pp) * self.pcp + pcp) * self.tp + tp

    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        tp = rank % self.tp
        rest = rank // self.tp
        pcp = rest % self.pcp
        rest //= self.pcp
        return RankCoord(dp=rest // self.pp, pp=rest % self.pp, pcp=pcp, tp=tp)

    def pcp_group(self, rank: int) -> list[int]:
        c = self.coord(rank)
        return [self.rank(c.dp, c.pp, r, c.tp) for r in range(self.pcp)]

    def pp_group(self, rank: int) -> list[int]:
        c = self.coord(rank)
        return [self.rank(c.dp, s, c.pcp, c.tp) for s in range(self.pp)]

    def ep_group(self, rank: int) -> list[int]:
        c = self.coord(rank)
        return [self.rank(d, c.pp, q, c.tp) for d in range(self.dp) for q in range(self.pcp)]

    def ep_rank(self, rank: int) -> int:
        """``rank``'s place in its EP group."""
        c = self.coord(rank)
        return c.dp * self.pcp + c.pcp

    def all_ep_groups(self) -> list[list[int]]:
        return _unique(self.ep_group(r) for r in range(self.world_size))

    def replica_ranks(self, dp: int) -> list[int]:
        return [r for r in range(self.world_size) if self.coord(r).dp == dp]

    def all_pcp_groups(self) -> list[list[int]]:
        return _unique(self.pcp_group(r) for r in range(self.world_size))

    def all_pp_groups(self) -> list[list[int]]:
        return _unique(self.pp_group(r) for r in range(self.world_size))

    def interleave(self, block_size: int) -> int:
        size = self.kv_interleave or block_size
        if size % block_size:
            raise ValueError(f"kv_interleave {size} must be a multiple of block_size {block_size}")
        return size


@dataclass(frozen=True)
class RankCoord:
    dp: int
    pp: int
    pcp: int
    tp: int = 0


def _unique(groups: object) -> list[list[int]]:
    seen: list[list[int]] = []
    for g in groups:  # type: ignore[attr-defined]
        if g not in seen:
            seen.append(g)
    return seen


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Layer range of a PP stage: contiguous, sizes differing by at most one (earlier stages larger)."""
    if pp > num_layers:
        raise ValueError(f"pp={pp} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))
