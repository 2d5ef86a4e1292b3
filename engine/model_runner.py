"""Turns a scheduled step into tensors, runs the model, and returns the logits the step needs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.cuda_graphs import DecodeGraphs
from engine.forward_batch import ForwardBatch, PrefillSegment, slots_for
from engine.kv_cache import KVCache
from engine.model import DeepseekForCausalLM, MTPLayer
from engine.mtp_graphs import MTPGraphs
from engine.overlap import Feed
from engine.parallel.expert_parallel import ExpertGroup, further_rows
from engine.scheduler import Scheduled
from engine.speculative import DraftsInFlight

# A step with prefill rows replays a graph when its rows fit the largest captured size and its
# prefill rows attend at most this many (row, key) pairs in all; 0 sends every step with a prefill
# eagerly. benchmarks/prefill_graphs.py on an H200 (V2-Lite's shape): a replay was 1.3-1.5x faster
# than eager at 1.2-1.7M pairs (2,048 cached + 500 new, 8,192 + 200) and 0.8x at 3.3-4.2M.
GRAPH_PREFILL_MAX_KEYS = 2_000_000


@dataclass
class StepLogits:
    """Logits of one scheduled request this step: ``rows`` of its new tokens (fp32 [n, V])."""

    first_row: int  # index within the request's new tokens of logits[0]
    logits: torch.Tensor


def logits_span(s: Scheduled) -> tuple[int, int] | None:
    """(first new row, row count) of a request's rows that need logits this step, or None.

    All rows while in the prompt when prompt logprobs/logits are wanted; else the last row when the
    step samples.
    """
    seq = s.seq
    if s.drafts:
        return 0, s.num_new  # every row: the target's token after each draft (engine.speculative)
    in_prompt = seq.num_computed < len(seq.prompt_token_ids)
    if in_prompt and (seq.params.prompt_logprobs is not None or seq.want_prompt_logits):
        return 0, s.num_new
    if s.samples:
        return s.num_new - 1, 1
    return None


def build_batch(scheduled: list[Scheduled], block_size: int, device: torch.device) -> ForwardBatch:
    """Scheduled requests (decode rows first) -> a ForwardBatch on ``device``."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[torch.Tensor] = []
    logits_rows: list[int] = []
    prefills: list[PrefillSegment] = []
    dec_tables: list[list[int]] = []
    dec_lens: list[int] = []
    row = 0
    for s in scheduled:
        seq, n = s.seq, s.num_new
        start = seq.num_computed
        toks = seq.tokens(start, start + n - len(s.drafts)) + s.drafts
        ids.extend(toks + [0] * (n - len(toks)))  # a token still on the device (pending): the feed writes it
        positions.extend(range(start, start + n))
        table = torch.tensor(seq.block_ids, dtype=torch.long)
        slots.append(slots_for(table, start, start + n, block_size))
        if n == 1 or s.drafts:  # a verify step's rows too: each attends the cache up to its own position
            assert not prefills, "decode rows must precede prefill segments"
            dec_tables += [seq.block_ids] * n
            dec_lens += range(start + 1, start + n + 1)
        else:
            prefills.append(PrefillSegment(row, n, start, table.to(device)))
        span = logits_span(s)
        if span is not None:
            logits_rows.extend(range(row + span[0], row + span[0] + span[1]))
        row += n
    width = max((len(t) for t in dec_tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in dec_tables]
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.cat(slots).to(device),
        num_decode=len(dec_tables),
        decode_block_tables=torch.tensor(padded, dtype=torch.long, device=device).view(len(padded), width),
        decode_seq_lens=torch.tensor(dec_lens, dtype=torch.long, device=device),
        decode_max_len=max(dec_lens, default=0),
        prefills=prefills,
        logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=device),
    )


@dataclass
class GraphRows:
    """A step as the rows of a graph replay, on the host (``ModelRunner._graph_rows``), before it replays."""

    ids: list[int]  # each row's token (0: still on the device, for the feed to write)
    positions: list[int]
    tables: list[list[int]]  # per request
    repeats: list[int] | None  # per request, its rows; None: a decode step (one row each: ``DecodeGraphs.run``)
    spans: list[tuple[int, int] | None]  # per request, ``logits_span``
    logit_rows: list[int]  # the rows whose logits the step needs

    @property
    def rows(self) -> int:
        return len(self.ids)


class ModelRunner:
    def __init__(self, model: DeepseekForCausalLM, cache: KVCache, device: torch.device,
                 graphs: DecodeGraphs | None = None, ep: ExpertGroup | None = None, draft_tokens: int = 1) -> None:
        """``ep``: the model is one member of an EP group of in-process engines, which step together (``run``,
        ``draft``); ``draft_tokens``: speculative decoding's k, the most MTP passes after a step."""
        self.model = model
        self.cache = cache
        self.device = device
        self.graphs = graphs  # decode-only steps replay these when they fit
        self.ep = ep
        self.draft_tokens = draft_tokens
        # Speculative decoding: the last step's batch and the target's hidden states [T, D], which the
        # multi-token prediction layer drafts from (``draft``), and the size of the graph it replayed (0: eager).
        self._last: tuple[ForwardBatch, torch.Tensor] | None = None
        self._replayed = 0
        # The MTP layer's passes as graphs after a replayed step (``attach_mtp_graphs``; not under EP).
        self.mtp_graphs: MTPGraphs | None = None

    def attach_mtp_graphs(self) -> None:
        """Capture the MTP layer's passes as CUDA graphs over the step graphs' buffers (``engine.mtp_graphs``),
        where the model drafts, its steps replay graphs, and no expert-parallel group sizes its passes."""
        if self.model.mtp is None or self.graphs is None or not self.graphs.sizes or self.ep is not None:
            return
        assert self.model.rope is not None
        index, layer = next(iter(self.model.mtp.items()))
        assert isinstance(layer, MTPLayer)
        mtp = MTPGraphs(self.graphs, layer, self.cache.layers[int(index)], self.model.rope, self.draft_tokens)
        if mtp.capture():
            self.mtp_graphs = mtp

    @torch.inference_mode()
    def run(self, scheduled: list[Scheduled], feed: Feed | None = None) -> list[StepLogits | None]:
        """One forward step -> per scheduled request its logits (None if it needs none this step).
        ``feed``: input tokens of decode rows still on the device (engine.overlap). Under expert parallelism
        every member of the group calls this in every step, rows or none (``_run_ep``)."""
        self._last = None
        self._replayed = 0
        graphs = self.graphs if self.graphs is not None and self.model.decode_form == "absorbed" else None
        rows = self._graph_rows(scheduled, graphs, feed) if graphs is not None and scheduled else None
        if self.ep is not None:
            return self._run_ep(scheduled, feed, graphs, rows)
        if rows is not None:
            assert graphs is not None
            return self._replay(rows, graphs, feed)
        return self._eager(scheduled, feed)

    def _run_ep(self, scheduled: list[Scheduled], feed: Feed | None, graphs: DecodeGraphs | None,
                rows: GraphRows | None) -> list[StepLogits | None]:
        """One step of an EP group's member. The members exchange their rows and whether each can replay its
        step (one all-gather: ``ExpertGroup.counts``); a member without rows can (padding rows only). If every
        one can, each replays the same graph, the smallest that holds the group's largest step, since the
        MoE layers' collectives in it are sized by it (``engine.cuda_graphs``); else each runs eagerly, and a
        member without rows runs only the MoE layers' collectives. Nothing runs where no member has rows."""
        assert self.ep is not None
        counts, replay = self.ep.counts(sum(s.num_new for s in scheduled),
                                        graphs is not None and (rows is not None or not scheduled))
        if not any(counts):
            return []
        if replay:
            assert graphs is not None
            size = graphs.size_for(max(counts))
            if rows is None:
                graphs.pad(size)
                return []
            return self._replay(rows, graphs, feed, size)
        if not scheduled:
            self.model.expert_collectives(counts)
            return []
        return self._eager(scheduled, feed, counts)

    def _eager(self, scheduled: list[Scheduled], feed: Feed | None,
               ep_counts: list[int] | None = None) -> list[StepLogits | None]:
        batch = build_batch(scheduled, self.cache.block_size, self.device)
        batch.ep_counts = ep_counts
        if feed is not None:
            feed.apply(batch.input_ids)
        hidden = self.model(batch, self.cache.layers)
        if self.model.mtp is not None:
            self._last = (batch, hidden)
        logits = self.model.compute_logits(hidden[batch.logits_rows]) if batch.logits_rows.numel() else None
        out: list[StepLogits | None] = []
        pos = 0
        for s in scheduled:
            span = logits_span(s)
            if span is None:
                out.append(None)
                continue
            first, k = span
            assert logits is not None
            out.append(StepLogits(first, logits[pos : pos + k]))
            pos += k
        return out

    def _graph_rows(self, scheduled: list[Scheduled], graphs: DecodeGraphs,
                    feed: Feed | None = None) -> GraphRows | None:
        """The step as the rows of one graph replay (decode rows, and prefill rows when they are cheap that
        way), or None to run it eagerly."""
        if all(s.num_new == 1 and logits_span(s) == (0, 1) for s in scheduled):  # decode only: the hot path
            seqs = [s.seq for s in scheduled]
            tables = [q.block_ids for q in seqs]
            if not graphs.fits(len(seqs), tables):
                return None
            known = [q.token_at(q.num_computed) if q.num_computed < q.num_tokens - q.pending else 0 for q in seqs]
            return GraphRows(known, [q.num_computed for q in seqs], tables, None, [(0, 1)] * len(seqs),
                             list(range(len(seqs))))
        rows = sum(s.num_new for s in scheduled)
        spans = [logits_span(s) for s in scheduled]
        if rows > graphs.max_rows or any(sp is not None and sp != (s.num_new - 1, 1) and not s.drafts
                                         for s, sp in zip(scheduled, spans)):
            return None  # too large, or prompt logprobs (logits of every prompt row): eager
        # A prefill row attends its whole context on its own (absorbed form), where the eager path
        # decompresses the context once per request: past this many (row, key) pairs eager is cheaper.
        # (A speculative step's verify rows are decode rows on either path.)
        keys = sum(s.num_new * s.seq.num_computed + s.num_new * (s.num_new + 1) // 2
                   for s in scheduled if s.num_new > 1 and not s.drafts)
        if keys > GRAPH_PREFILL_MAX_KEYS:
            return None
        tables = [s.seq.block_ids for s in scheduled]
        if not graphs.fits(rows, tables):
            return None
        ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        row = 0
        for s, sp in zip(scheduled, spans):
            start = s.seq.num_computed
            ids.extend(s.seq.tokens(start, start + s.num_new - len(s.drafts)) + s.drafts)
            positions.extend(range(start, start + s.num_new))
            if sp is not None:
                logit_rows.extend(range(row + sp[0], row + sp[0] + sp[1]))
            row += s.num_new
        return GraphRows(ids, positions, tables, [s.num_new for s in scheduled], spans, logit_rows)

    def _replay(self, step: GraphRows, graphs: DecodeGraphs, feed: Feed | None = None,
                size: int | None = None) -> list[StepLogits | None]:
        """Replay the graph of ``size`` rows (default: the smallest that holds the step) over ``step``'s rows."""
        if step.repeats is None:
            logits = graphs.run(step.ids, step.positions, step.tables, feed, size)
            self._keep_replayed(graphs, step.rows)
            return [StepLogits(0, logits[i : i + 1]) for i in range(step.rows)]
        logits = graphs.run_rows(step.ids, step.positions, step.tables, step.repeats, step.logit_rows, feed, size)
        self._keep_replayed(graphs, step.rows)
        out: list[StepLogits | None] = []
        k = 0
        for sp in step.spans:
            if sp is None:
                out.append(None)
            else:
                out.append(StepLogits(sp[0], logits[k : k + sp[1]]))
                k += sp[1]
        return out

    def _keep_replayed(self, graphs: DecodeGraphs, rows: int) -> None:
        """Speculative decoding: the replayed step's rows and hidden states, for the MTP pass (``draft``),
        which runs before the next replay overwrites them."""
        if self.model.mtp is not None:
            self._last = graphs.last_step(rows)
            self._replayed = graphs.last_size

    @torch.inference_mode()
    def draft(self, next_ids: list[int], picks: list[int], extra: list[int],
              tables: list[list[int]]) -> list[list[int]]:
        """Speculative decoding's drafts after the last step (``engine.speculative``). The MTP layer runs over
        every row of that step, row r with the target's hidden state there and ``next_ids[r]`` (the token
        after it), writing its own KV; at flat row ``picks[i]`` it predicts request i's first draft, then it
        runs ``extra[i]`` more times one row further each (request i's block table ``tables[i]`` covers
        those positions), each time on its own hidden state and the draft it made. Returns the drafts.

        Under expert parallelism every member calls this after every step (rows or none): the layer's MoE
        dispatches over the group in each pass that any member runs (``_pass_counts``), a member without rows
        in a pass running only its collectives. These passes run eagerly, also after a replayed step; without EP
        they replay as graphs after a replayed step (``engine.mtp_graphs``).

        Returns once the pass's writes are done on the device, also when no request drafts (then no drafts come
        to the host to wait for it): the engine frees the blocks of requests that finished at this step right
        after, and a decode node may hand them to a KV pull, whose writes the stream does not order."""
        drafts = self._draft(next_ids, picks, extra, tables)
        if not picks and next_ids and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return drafts

    @torch.inference_mode()
    def draft_ahead(self, next_ids: list[int], picks: list[int], extra: list[int],
                    tables: list[list[int]]) -> DraftsInFlight:
        """``draft``'s passes (with drafting requests: ``picks``), their drafts left on the device for a step
        launched before they reach the host (``engine.speculative``: ``Drafts.feed``), and copied to the host
        behind the passes alone. Eager passes bring them to the host as they go."""
        last = self._last
        mtp = self.mtp_graphs
        if mtp is None or last is None or not mtp.fits(self._replayed, len(picks)):
            known = self._draft(next_ids, picks, extra, tables)
            width = max(len(d) for d in known)
            padded = [d + [0] * (width - len(d)) for d in known]
            return DraftsInFlight(torch.tensor(padded, dtype=torch.long, device=self.device),
                                  [len(d) for d in known], known=known)
        self._last = None
        tokens = mtp.launch(self._replayed, next_ids, picks, extra, tables)
        lengths = [1 + e for e in extra]
        if tokens.device.type != "cuda":  # (the graphs' work run eagerly: tests on CPU; read when they land)
            return DraftsInFlight(tokens, lengths)
        with torch.cuda.device(tokens.device):  # (an engine thread's device need not be the current one)
            host = mtp.out_host[: len(picks)]
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tokens.device))
        return DraftsInFlight(tokens, lengths, host=host, ready=ready)

    def _draft(self, next_ids: list[int], picks: list[int], extra: list[int],
               tables: list[list[int]]) -> list[list[int]]:
        assert self.model.mtp is not None and self.model.rope is not None
        index, layer = next(iter(self.model.mtp.items()))  # DeepSeek's one layer drafts every token
        assert isinstance(layer, MTPLayer)
        cache, rope = self.cache.layers[int(index)], self.model.rope
        last, self._last = self._last, None
        mtp = self.mtp_graphs
        if mtp is not None and last is not None and mtp.fits(self._replayed, len(picks)):
            return mtp.run(self._replayed, next_ids, picks, extra, tables)
        passes = self._pass_counts(last, extra)
        if last is None:  # under EP, a member without rows this step
            for counts in passes or []:
                layer.expert_collectives(counts)
            return []
        batch, hidden = last
        if passes is not None:  # the rows as they ran (a replay's batch is padded to the group's size: not here)
            batch = dataclasses.replace(batch, ep_counts=passes[0], static=False)
        h = layer.predict(torch.tensor(next_ids, device=self.device), hidden, batch, cache, rope)
        rows = torch.tensor(picks, dtype=torch.long, device=self.device)
        h = h[rows]
        token = layer.compute_logits(h).argmax(-1)
        drafts = [[t] for t in token.tolist()]
        live = list(range(len(picks)))  # the requests still drafting, by index
        pos = batch.positions[rows]
        for j in range(1, len(passes) if passes is not None else max(extra, default=0) + 1):
            keep = [n for n, i in enumerate(live) if extra[i] >= j]
            if not keep:
                if passes is None:
                    break
                layer.expert_collectives(passes[j])  # other members' requests still draft
                continue
            sel = torch.tensor(keep, dtype=torch.long, device=self.device)
            live = [live[n] for n in keep]
            token, h, pos = token[sel], h[sel], pos[sel] + 1
            step = _decode_rows(token, pos, [tables[i] for i in live], self.cache.block_size, self.device)
            step.ep_counts = passes[j] if passes is not None else None
            h = layer.predict(token, h, step, cache, rope)
            token = layer.compute_logits(h).argmax(-1)
            for i, t in zip(live, token.tolist()):
                drafts[i].append(t)
        return drafts

    def _pass_counts(self, last: tuple[ForwardBatch, torch.Tensor] | None, extra: list[int]) -> list[list[int]] | None:
        """Under EP, the MTP passes the group runs after this step and every member's rows in each (None without
        EP): the first over every row of the step, pass j over the requests drafting more than j tokens. Every
        member's rows per pass, up to ``draft_tokens``, go in one exchange (``ExpertGroup.pass_counts``), and
        the group runs the passes in which any member has rows (a member's rows only shrink pass to pass)."""
        if self.ep is None:
            return None
        if not self.ep.rows:  # the step ran nowhere (every member knows): no pass, no exchange
            return []
        assert all(e < self.draft_tokens for e in extra)
        first = last[1].shape[0] if last is not None else 0  # the first pass: every row of the step
        return self.ep.pass_counts([first] + further_rows(extra, self.draft_tokens))


def _decode_rows(tokens: torch.Tensor, positions: torch.Tensor, tables: list[list[int]], block_size: int,
                 device: torch.device) -> ForwardBatch:
    """One decode row per request: ``tokens`` at ``positions`` (each request's block table covers it)."""
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)
    pos = positions.to(device)
    slots = padded.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1) * block_size + pos % block_size
    lens = pos + 1
    return ForwardBatch(input_ids=tokens, positions=pos, slot_mapping=slots, num_decode=len(tables),
                        decode_block_tables=padded, decode_seq_lens=lens, decode_max_len=int(lens.max().item()),
                        prefills=[], logits_rows=torch.arange(len(tables), device=device))
