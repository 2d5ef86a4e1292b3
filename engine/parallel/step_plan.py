"""One step of a DP replica: what the driver sends every rank, and each rank's local view of it.

The driver schedules globally (one request list per replica) and sends every rank the same
:class:`StepPlan`. Each rank derives deterministically, with no communication, its own rows (decode
rows on every PCP rank, zigzag rows of each prefill), where its rows land in the PCP all-gathers,
which new tokens it stores (sharded: the positions it owns; replicated: all), which context slots
it reads, and which of its rows feed the logits. All ranks of a PCP group therefore agree on every
collective's sizes without exchanging them.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.forward_batch import ForwardBatch
from engine.parallel.collectives import padded_index
from engine.parallel.grid import ParallelConfig
from engine.parallel.pcp_split import zigzag_runs
from engine.parallel.pcp_step import PCPStep, SegmentView


@dataclass
class PlanRow:
    """One scheduled request: ``token_ids`` are this step's new tokens, at positions ``start…``."""

    token_ids: torch.Tensor  # [n] int64 (a list is converted): pickles and slices without Python loops
    start: int
    block_ids: list[int]  # global block table covering start + len(token_ids) tokens
    logits: tuple[int, int] | None  # (first new row, count) whose logits the driver wants

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, torch.Tensor):
            self.token_ids = int_tensor(self.token_ids)

    @property
    def num_new(self) -> int:
        return int(self.token_ids.numel())


@dataclass
class StepPlan:
    rows: list[PlanRow]  # decode rows (one new token) first, then prefill segments

    def __post_init__(self) -> None:
        seen_prefill = False
        for r in self.rows:
            if r.num_new > 1:
                seen_prefill = True
            elif seen_prefill:
                raise ValueError("decode rows must precede prefill rows in a step plan")


def int_tensor(values: list[int]) -> torch.Tensor:
    """A list of ints as an int64 tensor, through a buffer (7x faster than torch.tensor for 32k)."""
    if not values:
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def _slots(table: torch.Tensor, pos: torch.Tensor, bs: int) -> torch.Tensor:
    return table[pos // bs] * bs + pos % bs


def _local_ids(global_ids: torch.Tensor, par: ParallelConfig, pcp_rank: int) -> torch.Tensor:
    """``kv_layout.local_block_ids`` on a tensor: this rank's physical id per logical block, or -1."""
    if par.kv_layout == "replicated" or par.pcp == 1:
        return global_ids
    return torch.where(global_ids % par.pcp == pcp_rank, global_ids // par.pcp, -1)


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Int64 tensors to the device in one host-to-device copy (each copy from pageable memory is a
    synchronous round trip of tens of microseconds; a step has a dozen of them)."""
    if device.type == "cpu":
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors]).pin_memory().to(device, non_blocking=True)
    out, off = [], 0
    for t in tensors:
        out.append(flat[off : off + t.numel()].view(t.shape))
        off += t.numel()
    return out


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class _Holders:
    """Which PCP ranks hold a position's KV: sharded, rank ``(pos // interleave) % pcp``; replicated, all."""

    pcp: int
    interleave: int
    sharded: bool

    def held(self, pos: torch.Tensor, rank: int) -> torch.Tensor:
        """[N] bool: which of the positions ``pos`` [N] ``rank`` holds."""
        return (pos // self.interleave) % self.pcp == rank if self.sharded else torch.ones_like(pos, dtype=torch.bool)


@dataclass
class _DecodeRows:
    """The step's decode rows on one rank (tensors on the host)."""

    lens: torch.Tensor  # [B] cached tokens incl. this step's
    tables: torch.Tensor  # [B, W] this rank's physical block ids (0 where it holds none)
    max_len: int
    mask: torch.Tensor  # [B, max_len] bool: cached positions this rank holds
    write_rows: torch.Tensor  # decode rows whose new KV this rank stores ...
    write_slots: torch.Tensor  # ... and where


def _decode_rows(decodes: list[PlanRow], tables: list[torch.Tensor], own: _Holders, r: int, bs: int) -> _DecodeRows:
    """Decode rows (``tables``: each one's local block ids): computed on every PCP rank; each holder stores
    the new token and attends its part."""
    nd = len(decodes)
    lens = torch.tensor([row.start + 1 for row in decodes], dtype=torch.long)
    width = max((len(row.block_ids) for row in decodes), default=0)
    padded = torch.zeros(nd, width, dtype=torch.long)
    for d in range(nd):
        padded[d, : tables[d].numel()] = tables[d].clamp_min(0)
    max_len = int(lens.max()) if nd else 0
    pos = torch.arange(max_len)
    mask = (pos[None, :] < lens[:, None]) & own.held(pos, r)[None, :]
    starts = torch.tensor([row.start for row in decodes], dtype=torch.long)
    write_rows = torch.nonzero(own.held(starts, r)).flatten() if nd else torch.zeros(0, dtype=torch.long)
    write_slots = _cat([_slots(tables[d], starts[d : d + 1], bs) for d in write_rows.tolist()])
    return _DecodeRows(lens, padded, max_len, mask, write_rows, write_slots)


@dataclass
class _PrefillRows:
    """The step's prefill segments on one rank (tensors on the host)."""

    zig: list[list[torch.Tensor]]  # [rank][segment]: the segment's new tokens that rank computes
    ids: list[torch.Tensor]  # this rank's rows' token ids ...
    positions: list[torch.Tensor]  # ... and positions, in row order
    segments: list[SegmentView]
    num_new: int  # new prefill tokens in the step, all ranks
    new_counts: list[int]
    new_index: torch.Tensor
    write_src: torch.Tensor
    write_slots: torch.Tensor
    num_ctx: int
    ctx_counts: list[int]
    read_slots: torch.Tensor
    ctx_index: torch.Tensor | None


def _prefill_rows(
    prefills: list[PlanRow], tables: list[torch.Tensor], first_row: int, own: _Holders, r: int, bs: int
) -> _PrefillRows:
    """Prefill segments (``tables``: each one's local block ids; their rows start at ``first_row``): zigzag
    rows per rank; every rank's share is needed for the gather indices."""
    P = own.pcp
    runs = [[zigzag_runs(row.num_new, P, q) for row in prefills] for q in range(P)]
    zig = [[_cat([torch.arange(a, b) for a, b in rs]) for rs in per_rank] for per_rank in runs]
    new_off, ctx_off, n_new, n_ctx = [], [], 0, 0
    for row in prefills:
        new_off.append(n_new)
        ctx_off.append(n_ctx)
        n_new += row.num_new
        n_ctx += row.start
    new_counts = [sum(int(z.numel()) for z in zig[q]) for q in range(P)]
    new_index = padded_index(
        [_cat([new_off[s] + zig[q][s] for s in range(len(prefills))]) for q in range(P)], new_counts, n_new
    )
    ids: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    segments: list[SegmentView] = []
    write_src: list[torch.Tensor] = []
    write_slots: list[torch.Tensor] = []
    read_slots: list[torch.Tensor] = []
    ctx_parts_by_rank: list[list[torch.Tensor]] = [[] for _ in range(P)]
    row0 = first_row
    for s, row in enumerate(prefills):
        table = tables[s]
        mine = zig[r][s]
        ids.extend(row.token_ids[a:b] for a, b in runs[r][s])
        positions.append(row.start + mine)
        segments.append(
            SegmentView(
                local_rows=slice(row0, row0 + mine.numel()),
                runs=runs[r][s],
                new=slice(new_off[s], new_off[s] + row.num_new),
                ctx=slice(ctx_off[s], ctx_off[s] + row.start),
            )
        )
        row0 += mine.numel()
        new_pos = row.start + torch.arange(row.num_new)
        keep = own.held(new_pos, r)
        write_src.append(new_off[s] + torch.nonzero(keep).flatten())
        write_slots.append(_slots(table, new_pos[keep], bs))
        ctx_pos = torch.arange(row.start)
        if own.sharded:
            for q in range(P):
                ctx_parts_by_rank[q].append(ctx_off[s] + ctx_pos[own.held(ctx_pos, q)])
            read_slots.append(_slots(table, ctx_pos[own.held(ctx_pos, r)], bs))
        else:
            read_slots.append(_slots(table, ctx_pos, bs))
    ctx_counts = [sum(int(t.numel()) for t in parts) for parts in ctx_parts_by_rank]
    ctx_index = padded_index([_cat(p) for p in ctx_parts_by_rank], ctx_counts, n_ctx) if own.sharded else None
    return _PrefillRows(zig, ids, positions, segments, n_new, new_counts, new_index, _cat(write_src),
                        _cat(write_slots), n_ctx, ctx_counts, _cat(read_slots), ctx_index)


def _logits_rows(
    rows: list[PlanRow], nd: int, zig: list[list[torch.Tensor]], r: int
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Logits rows: decode rows from PCP rank 0, prefill rows from the rank that computed them (``zig``, per
    rank and segment) -> (this rank's rows that feed the logits, rows per rank, plan-order logits row -> row
    of the padded all-gather)."""
    P = len(zig)
    num_prefills = len(rows) - nd
    per_rank_out: list[list[torch.Tensor]] = [[] for _ in range(P)]
    my_rows: list[torch.Tensor] = []
    out_off = 0
    seg_start = [[0] * num_prefills for _ in range(P)]
    for q in range(P):
        acc = 0
        for s in range(num_prefills):
            seg_start[q][s] = acc
            acc += int(zig[q][s].numel())
    for i, row in enumerate(rows):
        if row.logits is None:
            continue
        first, k = row.logits
        if i < nd:
            per_rank_out[0].append(torch.tensor([out_off]))
            if r == 0:
                my_rows.append(torch.tensor([i]))
        else:
            s = i - nd
            for q in range(P):
                z = zig[q][s]
                sel = torch.nonzero((z >= first) & (z < first + k)).flatten()
                per_rank_out[q].append(out_off + z[sel] - first)
                if q == r:
                    my_rows.append(nd + seg_start[q][s] + sel)
        out_off += k
    logits_counts = [sum(int(t.numel()) for t in parts) for parts in per_rank_out]
    return _cat(my_rows), logits_counts, padded_index([_cat(p) for p in per_rank_out], logits_counts, out_off)


def build_rank_batch(
    plan: StepPlan,
    par: ParallelConfig,
    pcp_rank: int,
    block_size: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> ForwardBatch:
    """This PCP rank's rows of ``plan`` as a ForwardBatch carrying its :class:`PCPStep`: decode rows first
    (``_decode_rows``), then its zigzag rows of each prefill (``_prefill_rows``), and the rows feeding the
    logits (``_logits_rows``), moved to ``device`` in one copy."""
    P, r, bs = par.pcp, pcp_rank, block_size
    own = _Holders(P, par.interleave(bs), par.kv_layout == "sharded" and P > 1)
    decodes = [row for row in plan.rows if row.num_new == 1]
    prefills = [row for row in plan.rows if row.num_new > 1]
    nd = len(decodes)
    local = [_local_ids(int_tensor(row.block_ids), par, r) for row in plan.rows]
    dec = _decode_rows(decodes, local[:nd], own, r, bs)
    pre = _prefill_rows(prefills, local[nd:], nd, own, r, bs)
    logits_rows, logits_counts, logits_index = _logits_rows(plan.rows, nd, pre.zig, r)

    host = {
        "dec_write_rows": dec.write_rows, "dec_write_slots": dec.write_slots, "new_index": pre.new_index,
        "new_write_src": pre.write_src, "new_write_slots": pre.write_slots, "ctx_read_slots": pre.read_slots,
        "ctx_index": pre.ctx_index if pre.ctx_index is not None else torch.zeros(0, dtype=torch.long),
        "logits_index": logits_index,
        "input_ids": _cat([row.token_ids for row in decodes] + pre.ids),
        "positions": _cat([torch.tensor([row.start]) for row in decodes] + pre.positions),
        "dec_tables": dec.tables, "dec_lens": dec.lens, "logits_rows": logits_rows,
    }
    on_dev = dict(zip(host, _to_device([t.long() for t in host.values()], device)))
    step = PCPStep(
        size=P, rank=r, group=group, sharded=own.sharded, num_decode=nd,
        dec_write_rows=on_dev["dec_write_rows"], dec_write_slots=on_dev["dec_write_slots"],
        dec_mask=dec.mask.to(device),
        segments=pre.segments, num_new=pre.num_new, new_counts=pre.new_counts, new_index=on_dev["new_index"],
        new_write_src=on_dev["new_write_src"], new_write_slots=on_dev["new_write_slots"],
        num_ctx=pre.num_ctx, ctx_counts=pre.ctx_counts, ctx_read_slots=on_dev["ctx_read_slots"],
        ctx_index=on_dev["ctx_index"] if pre.ctx_index is not None else None,
        logits_counts=logits_counts, logits_index=on_dev["logits_index"],
    )
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return ForwardBatch(
        input_ids=on_dev["input_ids"],
        positions=on_dev["positions"],
        slot_mapping=empty,
        num_decode=nd,
        decode_block_tables=on_dev["dec_tables"],
        decode_seq_lens=on_dev["dec_lens"],
        decode_max_len=dec.max_len,
        prefills=[],
        logits_rows=on_dev["logits_rows"],
        pcp=step,
    )


def local_token_counts(plan: StepPlan, pcp: int) -> list[int]:
    """Rows each PCP rank computes for ``plan`` (after the zigzag split): DP metadata per step."""
    nd = sum(1 for row in plan.rows if row.num_new == 1)
    return [
        nd + sum(b - a for row in plan.rows if row.num_new > 1 for a, b in zigzag_runs(row.num_new, pcp, q))
        for q in range(pcp)
    ]
