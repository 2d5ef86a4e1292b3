"""Steps of token rows as CUDA graphs: captured once per row count at start-up, replayed every step.

A decode step launches thousands of small kernels (2,500 for a V2-Lite-shaped model, measured);
launched from Python they leave the GPU idle most of the step. A graph replays all of them in one
launch. Captured per size of a ladder (1, 2, 4, 8, then every 16 up to the largest size, as vLLM's
``cudagraph_capture_sizes``); a step is padded to the next captured size, and a larger one runs eagerly.

A graph's step is a set of rows, each one token at its position attending its own cached context
(``t <= position``) in the absorbed form. A decode step is one row per request. A short prefill is
one row per new token (all rows' latents are written before any row attends, so row i sees the
prompt's tokens up to its own: causal): a prompt of a few hundred tokens, or a user turn after a
cached prefix, then costs one replay instead of ~1,300 launches (``ModelRunner`` decides which steps
go this way). Logits are computed in the graph for sizes up to ``max_batch`` (a decode step's);
above that the graph leaves the final hidden states and the logits of the rows that need them are
computed after the replay.

What makes a step capturable: its inputs live in static buffers (token ids, positions, cache slots,
block tables, context lengths) that each step fills with a few host-to-device copies before the
replay; decode attention is the fused kernel (``engine.mla_decode``: its grid depends on shapes
only); the MoE is two grouped GEMMs with device-side offsets. Padding rows read nothing (context
length 0) and write their latents into a spare cache block no request owns. Logits are computed in
the graph; sampling runs after it, on the host's schedule.

A model that cannot be captured (the per-expert MoE loop, which reads expert counts on the host,
runs off Hopper or in fp32) is reported once and runs eagerly.

Under expert parallelism (a decode node's DP replicas as one EP group, ``ExpertGroup``) every MoE layer's
dispatch and combine are collectives over the group, captured in the graphs: every member captures the
same ladder in the same order, in lockstep, the graph of ``size`` rows with each member's rows fixed at
``size`` (``ep_counts`` = [size] * EP), and keeps its graphs only if every member captured each size. A step
then replays one size on every member: the smallest captured size that holds the group's largest step
(``engine.model_runner`` agrees on it with the step's row counts), a member without rows replaying it with
padding rows only (``pad``). Padding rows route like any row, but attend nothing and are dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVCache
from engine.mla_decode import group_rows
from engine.model import DeepseekForCausalLM
from engine.overlap import Feed
from engine.parallel.expert_parallel import ExpertGroup

log = logging.getLogger(__name__)


# Graphs of at least this many rows serve a request's prefill rows in groups (``engine.mla_decode``'s
# ``grouped``: each tile of the request's context read once for a group of rows). Every replay of such
# a graph launches the grouped kernel, whose programs find nothing to do in a decode step: smaller
# graphs (decode steps of up to 127 requests) leave it out.
GROUPED_MIN_ROWS = 128


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, 8, then every 16, up to ``max_batch`` (which is included)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def graph_sizes(max_rows: int, max_batch: int) -> list[int]:
    """The sizes a model's graphs are captured for: the ladder up to the largest step (``max_rows``) and
    the decode batch limit itself, so a decode step never pads past ``max_batch``, the largest size
    whose graph computes logits."""
    return sorted(set(capture_sizes(max(max_rows, max_batch))) | {max_batch})


class DecodeGraphs:
    """Graphs of one model's step of token rows (decode steps, short prefills) for a ladder of row
    counts, over static input buffers."""

    def __init__(self, model: DeepseekForCausalLM, cache: KVCache, scratch_block: int, max_model_len: int,
                 max_batch: int, max_rows: int | None = None, ep: ExpertGroup | None = None) -> None:
        """``ep``: the model is one member of an EP group of in-process engines (module docstring)."""
        self.model = model
        self.ep = ep
        self.cache = cache
        self.block_size = cache.block_size
        self.width = -(-max_model_len // self.block_size)  # block-table entries per row
        self.scratch_slot = scratch_block * self.block_size  # padding rows write here
        self.sizes: list[int] = []
        device = next(iter(cache.layers.values())).device
        self.device = device  # captured and replayed with this device current (a DP replica's GPU)
        n = max(max_batch, max_rows or 0)
        # Static inputs (rows beyond a step's batch are padding).
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, self.width, dtype=torch.long, device=device)  # [n, W]
        self.lens = torch.zeros(n, dtype=torch.long, device=device)
        self.group = group_rows(model.cfg.num_attention_heads)  # 1: no grouping for this model
        self.grouped = torch.zeros(n, dtype=torch.int32, device=device)  # rows served in groups
        self._grouped_hw = 0  # every row of ``grouped`` from here on is 0
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool: torch.cuda._POOL_HANDLE | None = None  # the graphs' memory pool, once the first is captured
        # The replays' outputs: one buffer each that every size's graph writes its rows of (a graph's own
        # outputs would stay allocated per size: ~0.9 GB of logits over a 256-row ladder of V2-Lite's).
        assert model.lm_head is not None  # graphs are captured for a whole model (one process, one device)
        self.hidden = torch.empty(n, model.cfg.hidden_size, dtype=model.lm_head.weight.dtype, device=device)
        self._logits = torch.empty(max_batch, model.cfg.vocab_size, dtype=torch.float32, device=device)
        self.max_batch = max_batch  # the largest size whose graph computes logits
        self._max_rows = n
        self.last_size = 0  # the size the last step replayed
        self.replays = 0  # steps served by a graph (tests check graphs were really used)
        self.prefill_replays = 0  # of which steps with prefill rows
        self.pad_replays = 0  # of which, under EP, steps without rows of this member's (``pad``)

    # -- start-up --------------------------------------------------------------------------------
    def step_batch(self, size: int) -> ForwardBatch:
        """The static buffers' first ``size`` rows as a step's batch (what a graph of ``size`` rows runs)."""
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size], slot_mapping=self.slots[:size],
            num_decode=size, decode_block_tables=self.tables[:size], decode_seq_lens=self.lens[:size],
            decode_max_len=self.width * self.block_size, prefills=[],
            logits_rows=torch.arange(size, device=self.input_ids.device),
            decode_grouped=self.grouped[:size] if self.group > 1 and size >= GROUPED_MIN_ROWS else None,
            ep_counts=[size] * self.ep.shard.size if self.ep is not None else None, static=True,
        )

    def _forward(self, size: int) -> None:
        hidden = self.model(self.step_batch(size), self.cache.layers)
        self.hidden[:size].copy_(hidden)
        if size <= self.max_batch:
            self._logits[:size].copy_(self.model.lm_head(hidden))  # type: ignore[misc]  # [size, V] fp32

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size of the ladder (largest first, so smaller ones reuse its memory pool).
        On failure the graphs are dropped and the engine runs eagerly; the reason is logged. Under EP every
        member of the group calls this at once (collective)."""
        with torch.cuda.device(self.device):
            t0 = time.perf_counter()
            free0 = torch.cuda.mem_get_info()[0]
            captured = self.capture_ladder()
            torch.cuda.synchronize()
            if captured:
                used = (free0 - torch.cuda.mem_get_info()[0]) / 2**20
                log.info("captured CUDA graphs of token rows for %d sizes (1..%d rows) in %.1fs, %.0f MiB",
                         len(self.sizes), self.sizes[-1], time.perf_counter() - t0, used)

    def capture_ladder(self) -> bool:
        """Capture each size of the ladder, largest first (``_capture``); under EP, in lockstep with the other
        members, each size kept only if every member captured it (else none keeps any). Returns whether the
        graphs were captured (``sizes``)."""
        self.clear_rows()
        done: list[int] = []
        for size in reversed(graph_sizes(self._max_rows, self.max_batch)):
            why = ""
            try:
                self._capture(size)
            except Exception as e:  # a kernel that syncs with the host, or no room: run eagerly
                why = f"{type(e).__name__}: {e}"
            ok = not why
            if self.ep is not None:  # the group replays only sizes every member has (the MoE's collectives)
                ok = self.ep.every(ok)
                why = why or "another member of the expert-parallel group could not capture them"
            if not ok:
                log.warning("CUDA graphs disabled (%s); every step runs eagerly", why)
                self._graphs.clear()
                self._pool = None
                return False
            done.append(size)
        self.sizes = sorted(done)
        return True

    def clear_rows(self) -> None:
        """Every row of the static buffers a padding row (no context, its latents into the spare block)."""
        self.lens.zero_()
        self.grouped.zero_()
        self._grouped_hw = 0
        self.slots.fill_(self.scratch_slot)

    def _capture(self, size: int) -> None:
        self._graphs[size] = self.capture_graph(lambda: self._forward(size))

    def capture_graph(self, work: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """Capture ``work`` as a graph in these graphs' memory pool (after a warm-up on a side stream: Triton
        compiles its kernels for the launch parameters outside the capture, where loading a module is not
        allowed; and, under EP, the group's communicator is set up before the first capture). The pool is the
        first (largest) graph's, reused by later ones: their work must leave its results in static buffers,
        and never two of them run at once."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            work()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            work()
        self._pool = g.pool()
        return g

    # -- each step -------------------------------------------------------------------------------
    @property
    def max_rows(self) -> int:
        """The largest step a replay serves (0 when nothing was captured)."""
        return self.sizes[-1] if self.sizes else 0

    def fits(self, rows: int, block_tables: list[list[int]]) -> bool:
        return 0 < rows <= self.max_rows and all(len(t) <= self.width for t in block_tables)

    def size_for(self, rows: int) -> int:
        """The graph a step of ``rows`` rows replays: the smallest captured size that holds them."""
        return next(s for s in self.sizes if s >= rows)

    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
            feed: Feed | None = None, size: int | None = None) -> torch.Tensor:
        """One decode step of ``len(token_ids)`` rows (row i: its new token at ``positions[i]``, its
        blocks ``block_tables[i]``; ``feed``: tokens still on the device, written over ``token_ids``'
        placeholders) -> logits [B, V] fp32 (a copy: the next replay overwrites the graph's). ``size``: the
        graph to replay (under EP the group's; default ``size_for`` the rows)."""
        b = len(token_ids)
        size = self._replay(token_ids, positions, block_tables, [1] * b, feed, size)
        if size > self.max_batch:  # not while the scheduler caps a step's requests at max_batch
            return self.model.compute_logits(self.hidden[:b])
        return self._logits[:b].clone()

    def run_rows(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
                 repeats: list[int], logit_rows: list[int], feed: Feed | None = None,
                 size: int | None = None) -> torch.Tensor:
        """One step of token rows, request r's ``repeats[r]`` consecutive rows sharing its block table
        ``block_tables[r]`` -> logits [len(logit_rows), V] fp32 of the rows listed (``feed`` and ``size`` as for
        ``run``: a verify step's drafts may still be on the device)."""
        size = self._replay(token_ids, positions, block_tables, repeats, feed, size)
        self.prefill_replays += 1
        rows = torch.tensor(logit_rows, dtype=torch.long).to(self.device, non_blocking=True)
        if size <= self.max_batch:
            return self._logits[rows]
        return self.model.compute_logits(self.hidden[rows])

    def last_step(self, rows: int) -> tuple[ForwardBatch, torch.Tensor]:
        """The last replay's first ``rows`` rows as decode rows and their final hidden states [rows, D]:
        views of the graphs' buffers, valid until the next replay (speculative decoding's MTP pass)."""
        batch = ForwardBatch(
            input_ids=self.input_ids[:rows], positions=self.positions[:rows], slot_mapping=self.slots[:rows],
            num_decode=rows, decode_block_tables=self.tables[:rows], decode_seq_lens=self.lens[:rows],
            decode_max_len=self.width * self.block_size, prefills=[],
            logits_rows=torch.arange(rows, device=self.input_ids.device))
        return batch, self.hidden[:rows]

    def pad(self, size: int) -> None:
        """Under EP, a step without rows of this member's: replay the graph of ``size`` rows (the group's) with
        padding rows only, for the MoE layers' collectives (their outputs are dropped)."""
        if self.group > 1:
            self._grouped_hw = update_group_flags(self.grouped, np.zeros(0, dtype=np.int64), self._grouped_hw)
        self.lens[:size].zero_()
        self.slots[:size].fill_(self.scratch_slot)
        self._launch(size)
        self.replays += 1
        self.pad_replays += 1

    def _replay(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
                repeats: list[int], feed: Feed | None = None, size: int | None = None) -> int:
        b = len(token_ids)
        size = self.size_for(b) if size is None else size
        if not b <= size <= self.max_rows:
            raise ValueError(f"a step of {b} rows cannot replay the graph of {size}")
        group = self.group if size >= GROUPED_MIN_ROWS else 1
        host, table = row_inputs(token_ids, positions, block_tables, repeats, self.block_size, group)
        host_t = torch.from_numpy(host)
        self.input_ids[:b].copy_(host_t[0], non_blocking=True)
        if feed is not None:
            feed.apply(self.input_ids)
        self.positions[:b].copy_(host_t[1], non_blocking=True)
        self.slots[:b].copy_(host_t[2], non_blocking=True)
        self.lens[:b].copy_(host_t[3], non_blocking=True)
        if group > 1:
            self._grouped_hw = update_group_flags(self.grouped, host[4], self._grouped_hw)
        self.tables[:b, : table.shape[1]].copy_(torch.from_numpy(table), non_blocking=True)
        if size > b:  # padding rows: no context, their latents into the spare block
            self.lens[b:size].zero_()  # (their group flags are 0: update_group_flags keeps rows >= b clear)
            self.slots[b:size].fill_(self.scratch_slot)
        self._launch(size)
        self.replays += 1
        self.last_size = size
        return size

    def _launch(self, size: int) -> None:
        """Replay the graph of ``size`` rows over the static buffers just filled (tests on CPU run the
        captured step eagerly here instead: ``tests/unit/test_graph_rows_spec.py``)."""
        with torch.cuda.device(self.device):
            self._graphs[size].replay()


def update_group_flags(buf: torch.Tensor, flags: np.ndarray, high_water: int) -> int:
    """Write a step's group flags into rows ``[:len(flags)]`` of ``buf``, and clear the rows beyond them
    that an earlier (larger) step flagged; returns the new high-water mark: every row of ``buf`` from
    it on is 0. Steps with no flags over a clear buffer copy nothing (decode steps)."""
    b = len(flags)
    flagged = np.flatnonzero(flags)
    if flagged.size or high_water:
        buf[:b].copy_(torch.from_numpy(flags), non_blocking=True)
        if high_water > b:
            buf[b:high_water].zero_()
    return int(flagged[-1]) + 1 if flagged.size else 0


def row_inputs(token_ids: list[int], positions: list[int], block_tables: list[list[int]], repeats: list[int],
               block_size: int, group: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A step's rows on the host: [5, B] (token id, position, cache slot, context length incl. the row's
    own token, 1 on rows served in groups) and the block tables [B, W], request r's ``repeats[r]``
    consecutive rows sharing ``block_tables[r]``. With ``group`` > 1, each run of ``group`` rows that
    starts at a multiple of it and lies inside one request's rows is flagged."""
    b = len(token_ids)
    table = np.zeros((b, max(len(t) for t in block_tables)), dtype=np.int64)  # 3x faster than torch.tensor
    host = np.empty((5, b), dtype=np.int64)
    host[4] = 0
    row = 0
    for t, k in zip(block_tables, repeats):
        table[row : row + k, : len(t)] = t
        if group > 1 and k >= group:
            first = -(-row // group) * group
            last = (row + k) // group * group  # groups [first, last) lie inside the request's rows
            if last > first:
                host[4, first:last] = 1
        row += k
    pos = np.asarray(positions, dtype=np.int64)
    host[0] = token_ids
    host[1] = pos
    host[2] = table[np.arange(b), pos // block_size] * block_size + pos % block_size
    host[3] = pos + 1  # a row attends its context up to itself: the rows of one prompt are causal
    return host, table
