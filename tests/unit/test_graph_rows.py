"""Prefill as rows (``ModelRunner``'s graph path), checked on the CPU.

On a GPU a step of token rows is one CUDA-graph replay (``engine.cuda_graphs``): a decode step is
one row per request, a short prefill one row per new token, each row attending its own context in
the absorbed form. Here a stand-in runs the same rows (``row_inputs``) eagerly, so the runner's
choice of steps, the rows' causality and their logits are checked token for token in fp32 against
ordinary eager steps: short prompts, prompts after a cached prefix, chunked prompts beside running
decodes, and the steps that must stay eager (prompt logprobs, too many rows or keys).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams, model_runner
from engine.cuda_graphs import graph_sizes, row_inputs, update_group_flags
from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVCache
from engine.model import DeepseekForCausalLM
from engine.overlap import Feed


class EagerRows:
    """``DecodeGraphs``' interface; each 'replay' runs its rows eagerly."""

    def __init__(self, model: DeepseekForCausalLM, cache: KVCache, max_rows: int) -> None:
        self.model, self.cache, self.max_rows = model, cache, max_rows
        self.block_size = cache.block_size
        self.replays = 0
        self.prefill_replays = 0
        self.fed = 0  # steps run on tokens still on the device (engine.overlap)

    def fits(self, rows: int, block_tables: list[list[int]]) -> bool:
        return 0 < rows <= self.max_rows

    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
            feed: Feed | None = None, size: int | None = None) -> torch.Tensor:
        self.prefill_replays -= 1  # counted back in run_rows: this is a decode step
        return self.run_rows(token_ids, positions, block_tables, [1] * len(token_ids), list(range(len(token_ids))),
                             feed=feed)

    def run_rows(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
                 repeats: list[int], logit_rows: list[int], feed: Feed | None = None,
                 size: int | None = None) -> torch.Tensor:
        # (``size``, the graph to pad to under expert parallelism: rows are run as they are here)
        host, table = row_inputs(token_ids, positions, block_tables, repeats, self.block_size)
        t = torch.from_numpy(host)
        if feed is not None:
            self.fed += 1
            feed.apply(t[0])
        rows = torch.tensor(logit_rows, dtype=torch.long)
        batch = ForwardBatch(input_ids=t[0], positions=t[1], slot_mapping=t[2], num_decode=len(token_ids),
                             decode_block_tables=torch.from_numpy(table), decode_seq_lens=t[3],
                             decode_max_len=int(t[3].max()), prefills=[], logits_rows=rows)
        hidden = self.model(batch, self.cache.layers)
        self.replays += 1
        self.prefill_replays += 1
        return self.model.compute_logits(hidden[rows])


KW = dict(dtype="float32", device="cpu", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, 900, (40,), generator=g).tolist()
    prompts = [torch.randint(3, 900, (n,), generator=g).tolist() for n in (3, 30, 100, 9)]
    return prompts + [system + torch.randint(3, 900, (n,), generator=g).tolist() for n in (1, 5, 20, 70)]


def _generate(tiny_model, rows: int | None, one_at_a_time: bool, overlap: bool = False,
              **params) -> tuple[list, EagerRows | None]:
    prompts = _prompts()
    sp = SamplingParams(max_tokens=5, temperature=0.0, logprobs=1, ignore_eos=True, **params)
    with LLM(str(tiny_model), async_scheduling=overlap, **KW) as llm:
        stand_in = None
        if rows is not None:
            ex = llm.engine.executor
            stand_in = EagerRows(ex.model, ex.cache, rows)
            ex.runner.graphs = stand_in
        if one_at_a_time:  # each prompt alone: later ones hit the system prompt's cached blocks
            outs = [llm.generate([p], sp)[0] for p in prompts]
        else:  # all at once: chunks of 64 tokens beside running decodes
            outs = llm.generate(prompts, sp)
        assert llm.engine.num_used_blocks == 0
    return outs, stand_in


def _assert_equal(want: list, got: list) -> None:
    for w, g in zip(want, got):
        assert w.token_ids == g.token_ids
        assert w.logprobs == pytest.approx(g.logprobs, abs=1e-4)


@pytest.mark.parametrize("one_at_a_time", [True, False], ids=["alone", "batched"])
def test_rows_equal_eager_steps(tiny_model, one_at_a_time: bool) -> None:
    want, _ = _generate(tiny_model, None, one_at_a_time)
    got, stand_in = _generate(tiny_model, 64, one_at_a_time)
    assert stand_in is not None and stand_in.prefill_replays >= 4
    _assert_equal(want, got)
    got, stand_in = _generate(tiny_model, 64, one_at_a_time, overlap=True)  # decode replays fed on the device
    assert stand_in is not None and stand_in.fed > 0
    _assert_equal(want, got)


def test_steps_that_stay_eager(tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt logprobs need every prompt row's logits; more rows than the largest graph, or more
    (row, key) pairs than GRAPH_PREFILL_MAX_KEYS, cost less eagerly: no prefill replays."""
    want, _ = _generate(tiny_model, None, True, prompt_logprobs=1)
    got, stand_in = _generate(tiny_model, 64, True, prompt_logprobs=1)
    assert stand_in is not None and stand_in.prefill_replays == 0 and stand_in.replays > 0  # decode only
    _assert_equal(want, got)
    _, stand_in = _generate(tiny_model, 2, True)
    assert stand_in is not None and stand_in.prefill_replays == 0
    monkeypatch.setattr(model_runner, "GRAPH_PREFILL_MAX_KEYS", 0)
    _, stand_in = _generate(tiny_model, 64, True)
    assert stand_in is not None and stand_in.prefill_replays == 0


def test_row_inputs_flag_aligned_groups_inside_one_request() -> None:
    """Rows served in groups of 4: only runs that start at a multiple of 4 and lie inside one request."""
    repeats = [1, 1, 1, 10, 2, 9]  # three decode rows; rows 3-12, 13-14 and 15-23 are three prefills
    n = sum(repeats)
    tables = [[r + 1] * 3 for r in range(len(repeats))]
    positions = [0, 0, 0] + list(range(10)) + [5, 6] + list(range(9))
    host, table = row_inputs(list(range(n)), positions, tables, repeats, block_size=16, group=4)
    assert host.shape == (5, n) and table.shape == (n, 3)
    assert [i for i in range(n) if host[4, i]] == [4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19, 20, 21, 22, 23]
    assert not row_inputs(list(range(n)), positions, tables, repeats, block_size=16)[0][4].any(), "group 1: none"


def test_group_flags_never_outlive_their_step() -> None:
    """A graph's flag buffer across replays of different sizes: a larger step's flags beyond a smaller
    step's rows are cleared by it, so a later step (of any size) sees only its own flags."""
    buf = torch.zeros(512, dtype=torch.int32)
    hw = 0
    steps = [(200, range(8, 200)), (120, range(0)), (250, range(0)), (300, range(100, 300)), (40, range(0, 40)),
             (300, range(0))]
    for b, flagged in steps:
        flags = np.zeros(b, dtype=np.int64)
        flags[list(flagged)] = 1
        hw = update_group_flags(buf, flags, hw)
        assert torch.equal(buf[:b], torch.from_numpy(flags).to(torch.int32)), b
        assert not buf[b:].any(), f"stale flags past a {b}-row step"
        assert not buf[hw:].any()


@pytest.mark.parametrize(("max_rows", "max_batch"), [(320, 264), (512, 100), (256, 256), (16, 64), (8, 8)])
def test_no_decode_step_pads_past_the_decode_batch_limit(max_rows: int, max_batch: int) -> None:
    """Only graphs of up to ``max_batch`` rows compute logits, so every decode batch (1..max_batch) must
    find its padded size at or below it; larger steps (prefill rows) still find a size up to max_rows."""
    sizes = graph_sizes(max_rows, max_batch)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max(max_rows, max_batch)
    for b in range(1, max_batch + 1):
        assert b <= next(s for s in sizes if s >= b) <= max_batch
    for rows in range(max_batch + 1, max_rows + 1):
        assert next(s for s in sizes if s >= rows) - rows < 16
