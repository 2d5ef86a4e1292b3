"""Speculative decoding's MTP passes as CUDA graphs, after a step replayed as one (``engine.cuda_graphs``).

Run eagerly, the MTP layer's passes after a decode step cost about as much as the replayed step itself at
small batches (one layer's ~100 kernels launched from Python, and a host sync per pass): the step's graph
saves what the passes then spend again. Here they replay as two graphs per step:

- **the first pass** (``first``, one per size of the step graphs' ladder): the MTP layer over every row of the
  step just replayed, reading that replay's static buffers (positions, cache slots, block tables, context
  lengths and its final hidden states, ``DecodeGraphs``) and the token after each row (``next_ids``), writing
  the layer's KV and its hidden state at each row;
- **the drafts** (``drafts``, one per size up to the step graphs' ``max_batch``): the rows that predict a draft
  (``picks``: each drafting request's last computed row) gathered, the head's argmax taken, then the layer run
  ``k - 1`` more times one position further each over those rows (their block tables copied in, since the
  scheduler may have just grown them), each on its own hidden state and the draft it made. A row whose request
  drafts fewer tokens (``extra``) than a pass needs attends nothing in it and writes its KV into the spare
  block no request owns; its drafts past its own are dropped on the host.

The drafts of every request come back in one copy to the host (the eager passes sync once per pass), or stay on
the device (``launch``) for a step launched before they reach the host (``engine.speculative``). Padding
rows (a step padded to its graph's size) are run and dropped as in the step's graph. Not under expert
parallelism: there the group's passes have sizes that change every step and collectives in them
(``ModelRunner.draft`` runs those eagerly).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from engine.cuda_graphs import DecodeGraphs
from engine.forward_batch import ForwardBatch
from engine.model import MTPLayer
from engine.rope import RotaryEmbedding
from engine.speculative import DraftsInFlight

log = logging.getLogger(__name__)


class MTPGraphs:
    """The MTP layer's passes over a replayed step's rows (module docstring), ``k`` drafts per request at most."""

    def __init__(self, graphs: DecodeGraphs, layer: MTPLayer, cache: torch.Tensor, rope: RotaryEmbedding,
                 k: int) -> None:
        self.steps = graphs
        self.layer = layer
        self.cache = cache
        self.rope = rope
        self.k = k
        dev = graphs.device
        n, p = graphs.input_ids.shape[0], graphs.max_batch
        self.next_ids = torch.zeros(n, dtype=torch.long, device=dev)  # the token after each row of the step
        self.hidden = torch.empty_like(graphs.hidden)  # the first pass's hidden state at each row
        self.picks = torch.zeros(p, dtype=torch.long, device=dev)  # per drafting request: its row in the step
        self.extra = torch.zeros(p, dtype=torch.long, device=dev)  # ... and its drafts after the first
        self.tables = torch.zeros(p, graphs.width, dtype=torch.long, device=dev)  # ... and its block table
        self.out = torch.zeros(p, k, dtype=torch.long, device=dev)  # the drafts
        # ... and where they reach the host when a step is launched before they do (``ModelRunner.draft_ahead``)
        self.out_host = torch.zeros(p, k, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._first: dict[int, torch.cuda.CUDAGraph] = {}
        self._drafts: dict[int, torch.cuda.CUDAGraph] = {}
        self.first_sizes: list[int] = []
        self.draft_sizes: list[int] = []
        self.replays = 0  # steps whose passes replayed (tests check the graphs were used)

    # -- the captured work ------------------------------------------------------------------------
    def _first_pass(self, size: int) -> None:
        batch = self.steps.step_batch(size)
        h = self.layer.predict(self.next_ids[:size], self.steps.hidden[:size], batch, self.cache, self.rope)
        self.hidden[:size].copy_(h)

    def _draft_passes(self, p: int) -> None:
        steps, bs = self.steps, self.steps.block_size
        rows = self.picks[:p]
        h = self.hidden[rows]
        token = self.layer.compute_logits(h).argmax(-1)
        self.out[:p, 0].copy_(token)
        base = steps.positions[rows]
        tables = self.tables[:p]
        scratch = torch.full_like(base, steps.scratch_slot)
        for j in range(1, self.k):
            live = self.extra[:p] >= j
            pos = torch.where(live, base + j, base)  # a row done drafting keeps a position its table covers
            block = tables.gather(1, (pos // bs).unsqueeze(1)).squeeze(1)
            batch = ForwardBatch(
                input_ids=token, positions=pos, slot_mapping=torch.where(live, block * bs + pos % bs, scratch),
                num_decode=p, decode_block_tables=tables, decode_seq_lens=torch.where(live, pos + 1, 0),
                decode_max_len=steps.width * bs, prefills=[], logits_rows=torch.arange(p, device=base.device),
                static=True)
            h = self.layer.predict(token, h, batch, self.cache, self.rope)
            token = self.layer.compute_logits(h).argmax(-1)
            self.out[:p, j].copy_(token)

    # -- start-up --------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> bool:
        """Capture the first pass for every size of the step graphs and the drafts for every size up to their
        ``max_batch``, largest first, in the step graphs' memory pool. On failure none is kept (the passes then
        run eagerly) and the reason is logged. Returns whether they were captured."""
        steps = self.steps
        with torch.cuda.device(steps.device):
            t0 = time.perf_counter()
            free0 = torch.cuda.mem_get_info()[0]
            steps.clear_rows()
            self.extra.zero_()
            try:
                for size in reversed(steps.sizes):
                    self._first[size] = steps.capture_graph(functools.partial(self._first_pass, size))
                self.first_sizes = sorted(self._first)
                for size in reversed([s for s in steps.sizes if s <= steps.max_batch]):
                    self._drafts[size] = steps.capture_graph(functools.partial(self._draft_passes, size))
                self.draft_sizes = sorted(self._drafts)
            except Exception as e:  # a kernel that syncs with the host, or no room: the passes run eagerly
                log.warning("MTP passes not captured as CUDA graphs (%s: %s); they run eagerly", type(e).__name__, e)
                self._first.clear()
                self._drafts.clear()
                self.first_sizes, self.draft_sizes = [], []
                return False
            torch.cuda.synchronize()
            log.info("captured the MTP layer's passes as CUDA graphs (%d + %d sizes, k=%d) in %.1fs, %.0f MiB",
                     len(self.first_sizes), len(self.draft_sizes), self.k, time.perf_counter() - t0,
                     (free0 - torch.cuda.mem_get_info()[0]) / 2**20)
        return True

    # -- each step -------------------------------------------------------------------------------
    def fits(self, size: int, drafting: int) -> bool:
        """Whether the passes after a replay of the graph of ``size`` rows with ``drafting`` requests replay."""
        return size in self.first_sizes and 0 < drafting <= (self.draft_sizes[-1] if self.draft_sizes else 0)

    def run(self, size: int, next_ids: list[int], picks: list[int], extra: list[int],
            tables: list[list[int]]) -> list[list[int]]:
        """The passes after the replay of the graph of ``size`` rows whose first ``len(next_ids)`` rows are the
        step's (``ModelRunner.draft``'s arguments) -> each drafting request's drafts."""
        return DraftsInFlight(self.launch(size, next_ids, picks, extra, tables), [1 + e for e in extra]).result()

    def launch(self, size: int, next_ids: list[int], picks: list[int], extra: list[int],
               tables: list[list[int]]) -> torch.Tensor:
        """``run``'s passes queued on the device -> their drafts there, [picks, k] (row i: pick i's ``1 +
        extra[i]``, then whatever), until the next passes overwrite them."""
        n, p = len(next_ids), len(picks)
        dev = self.steps.device
        self.next_ids[:n].copy_(torch.tensor(next_ids, dtype=torch.long), non_blocking=True)
        self._launch_first(size)
        padded = next(s for s in self.draft_sizes if s >= p)
        host = torch.zeros(2, padded, dtype=torch.long)  # picks and extra, padding rows drafting nothing
        host[0, :p] = torch.tensor(picks, dtype=torch.long)
        host[1, :p] = torch.tensor(extra, dtype=torch.long)
        self.picks[:padded].copy_(host[0].to(dev, non_blocking=True))
        self.extra[:padded].copy_(host[1].to(dev, non_blocking=True))
        if self.k > 1 and any(extra):
            width = max(len(t) for t in tables)
            table = torch.zeros(p, width, dtype=torch.long)
            for i, t in enumerate(tables):
                table[i, : len(t)] = torch.tensor(t, dtype=torch.long)
            self.tables[:p, :width].copy_(table.to(dev, non_blocking=True))
        self._launch_drafts(padded)
        self.replays += 1
        return self.out[:p]

    def _launch_first(self, size: int) -> None:
        """Replay the first pass's graph (tests on CPU run the captured work eagerly here and in
        ``_launch_drafts``: tests/unit/test_graph_rows_spec.py)."""
        with torch.cuda.device(self.steps.device):
            self._first[size].replay()

    def _launch_drafts(self, size: int) -> None:
        with torch.cuda.device(self.steps.device):
            self._drafts[size].replay()
