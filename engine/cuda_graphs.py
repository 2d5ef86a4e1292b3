"""Decode steps as CUDA graphs: captured once per batch size at start-up, replayed every step.

A decode step launches thousands of small kernels (2,500 for a V2-Lite-shaped model, measured);
launched from Python they leave the GPU idle most of the step. A graph replays all of them in one
launch. Captured per size of a ladder (1, 2, 4, 8, then every 16 up to ``max_num_seqs``, as vLLM's
``cudagraph_capture_sizes``); a batch is padded to the next captured size, and a step that is not
decode-only, or is larger than the largest size, runs eagerly.

What makes a step capturable: its inputs live in static buffers (token ids, positions, cache slots,
block tables, context lengths) that each step fills with a few host-to-device copies before the
replay; decode attention is the fused kernel (``engine.mla_decode``: its grid depends on shapes
only); the MoE is two grouped GEMMs with device-side offsets. Padding rows read nothing (context
length 0) and write their latents into a spare cache block no request owns. Logits are computed in
the graph; sampling runs after it, on the host's schedule.

A model that cannot be captured (the per-expert MoE loop, which reads expert counts on the host,
runs off Hopper or in fp32) is reported once and runs eagerly.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVCache
from engine.model import DeepseekForCausalLM

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, 8, then every 16, up to ``max_batch`` (which is included)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """Graphs of one model's decode step for a ladder of batch sizes, over static input buffers."""

    def __init__(self, model: DeepseekForCausalLM, cache: KVCache, scratch_block: int, max_model_len: int,
                 max_batch: int) -> None:
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.width = -(-max_model_len // self.block_size)  # block-table entries per row
        self.scratch_slot = scratch_block * self.block_size  # padding rows write here
        self.sizes: list[int] = []
        device = next(iter(cache.layers.values())).device
        self.device = device  # captured and replayed with this device current (a DP replica's GPU)
        n = max_batch
        # Static inputs (rows beyond a step's batch are padding).
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, self.width, dtype=torch.long, device=device)  # [n, W]
        self.lens = torch.zeros(n, dtype=torch.long, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # size -> [size, V] fp32, written by the replay
        self._max_batch = max_batch
        self.replays = 0  # steps served by a graph (tests check graphs were really used)

    # -- start-up --------------------------------------------------------------------------------
    def _batch(self, size: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size], slot_mapping=self.slots[:size],
            num_decode=size, decode_block_tables=self.tables[:size], decode_seq_lens=self.lens[:size],
            decode_max_len=self.width * self.block_size, prefills=[],
            logits_rows=torch.arange(size, device=self.input_ids.device),
        )

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(self._batch(size), self.cache.layers)
        return self.model.compute_logits(hidden)  # [size, V]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size of the ladder (largest first, so smaller ones reuse its memory pool).
        On failure the graphs are dropped and the engine runs eagerly; the reason is logged."""
        with torch.cuda.device(self.device):
            self._capture()

    def _capture(self) -> None:
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info()[0]
        self.lens.zero_()
        self.slots.fill_(self.scratch_slot)
        pool = None
        try:
            for size in reversed(capture_sizes(self._max_batch)):
                # Warm-up at this size on a side stream: Triton compiles its kernels for the size's
                # launch parameters outside the capture (loading a module is not allowed inside one).
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._forward(size)
                torch.cuda.current_stream().wait_stream(stream)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self._logits[size] = self._forward(size)
                pool = g.pool()
                self._graphs[size] = g
        except Exception as e:  # a kernel that syncs with the host, or no room: run eagerly
            log.warning("decode CUDA graphs disabled (%s: %s); decode runs eagerly", type(e).__name__, e)
            self._graphs.clear()
            self._logits.clear()
            torch.cuda.synchronize()
            return
        torch.cuda.synchronize()
        self.sizes = sorted(self._graphs)
        used = (free0 - torch.cuda.mem_get_info()[0]) / 2**20
        log.info("captured decode CUDA graphs for %d batch sizes (1..%d) in %.1fs, %.0f MiB", len(self.sizes),
                 self.sizes[-1], time.perf_counter() - t0, used)

    # -- each step -------------------------------------------------------------------------------
    def fits(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> bool:
        return bool(self.sizes) and len(token_ids) <= self.sizes[-1] and all(
            len(t) <= self.width for t in block_tables)

    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """One decode step of ``len(token_ids)`` rows (row i: its new token at ``positions[i]``, its
        blocks ``block_tables[i]``) -> logits [B, V] fp32 (a copy: the next replay overwrites the graph's)."""
        b = len(token_ids)
        size = next(s for s in self.sizes if s >= b)
        bs = self.block_size
        width = max(len(t) for t in block_tables)
        slots = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, positions)]
        host = torch.tensor([token_ids, positions, slots, [p + 1 for p in positions]], dtype=torch.long)
        self.input_ids[:b].copy_(host[0], non_blocking=True)
        self.positions[:b].copy_(host[1], non_blocking=True)
        self.slots[:b].copy_(host[2], non_blocking=True)
        self.lens[:b].copy_(host[3], non_blocking=True)
        table = np.zeros((b, width), dtype=np.int64)  # filled row by row: 3x faster than torch.tensor of lists
        for i, t in enumerate(block_tables):
            table[i, :len(t)] = t
        self.tables[:b, :width].copy_(torch.from_numpy(table), non_blocking=True)
        if size > b:  # padding rows: no context, their latents into the spare block
            self.lens[b:size].zero_()
            self.slots[b:size].fill_(self.scratch_slot)
        with torch.cuda.device(self.device):
            self._graphs[size].replay()
        self.replays += 1
        return self._logits[size][:b].clone()
