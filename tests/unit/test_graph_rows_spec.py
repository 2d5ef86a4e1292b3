"""Speculative decoding through the CUDA-graph path on CPU: ``ModelRunner`` builds each step as the rows of a graph
(``DecodeGraphs``: static buffers, decode steps and short prefills as rows each attending up to its own
position, speculative decoding's verify rows with their drafts, the MTP pass over the replayed step's hidden
states), and here each "replay" runs the captured step's forward eagerly (``_launch``), since capturing needs
CUDA. tests/unit/test_graph_rows.py checks plain steps as rows with a stand-in of the interface; here the real
``DecodeGraphs`` assembles them. tests/gpu/test_cuda_graphs.py and test_mtp_gpu.py replay real graphs."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs
from engine.mtp_graphs import MTPGraphs
from pdctl.tiny_model import make_tiny_model

KW = dict(dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, logprobs=1, ignore_eos=True)


class EagerRows(DecodeGraphs):
    """Every row count "captured" (so no step pads), each replay the step's forward run eagerly over the buffers
    the replay filled. The cache gains the spare block a GPU executor's has (where padding rows and the MTP
    passes' rows done drafting write)."""

    def __init__(self, llm: LLM, max_rows: int, sizes: list[int] | None = None) -> None:
        """``sizes``: the ladder "captured" (default every size, so no step pads)."""
        ex = llm.engine.executor
        spare = ex.cache.num_blocks
        for i, t in ex.cache.layers.items():
            ex.cache.layers[i] = torch.cat([t, t.new_zeros(1, *t.shape[1:])])
        super().__init__(ex.model, ex.cache, spare, KW["max_model_len"], KW["max_num_seqs"], max_rows)
        self.sizes = sizes or list(range(1, max_rows + 1))

    def _launch(self, size: int) -> None:
        self._forward(size)


class EagerMTP(MTPGraphs):
    """The MTP passes' graphs "captured" for every size, each replay their work run eagerly."""

    def __init__(self, llm: LLM, rows: EagerRows) -> None:
        ex = llm.engine.executor
        layer = next(iter(ex.model.mtp.values()))
        super().__init__(rows, layer, ex.cache.layers[ex.num_layers], ex.model.rope, ex.runner.draft_tokens)
        self.first_sizes = rows.sizes
        self.draft_sizes = [s for s in rows.sizes if s <= rows.max_batch]

    def _launch_first(self, size: int) -> None:
        self._first_pass(size)

    def _launch_drafts(self, size: int) -> None:
        self._draft_passes(size)


def graph_path(llm: LLM, mtp: bool, sizes: list[int] | None = None) -> tuple[EagerRows, EagerMTP | None]:
    """The engine's steps as graph rows, and with ``mtp`` its MTP passes as the passes' graphs (``sizes``: the
    ladder, default every size)."""
    runner = llm.engine.executor.runner
    rows = EagerRows(llm, max_rows=64, sizes=sizes)
    runner.graphs = rows
    runner.mtp_graphs = EagerMTP(llm, rows) if mtp else None
    return rows, runner.mtp_graphs


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("rows") / "v3-mtp", arch="v3", moe=True, seed=7, mtp_layers=1)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(4, 1000, (n,), generator=g).tolist() for n in (5, 30, 12, 47)]


@pytest.fixture(scope="module")
def reference(mtp_model: Path) -> list:
    with LLM(str(mtp_model), **KW) as llm:
        return llm.generate(prompts(), GREEDY)


@pytest.mark.parametrize("k,ahead", [(0, False), (1, False), (3, False), (1, True), (3, True)],
                         ids=["k0", "k1", "k3", "k1-ahead", "k3-ahead"])
def test_steps_as_graph_rows_equal_eager_steps(mtp_model: Path, reference: list, k: int, ahead: bool) -> None:
    """Greedy tokens and logprobs through the graph rows (k = 0: plain decoding; k > 0: MTP drafts verified
    as graph rows, the MTP passes as their graphs' work on the replay's buffers) equal the eager engine's
    without drafts. ``ahead`` (``async_scheduling``, a GPU's default): each step is launched before its drafts
    reach the host, its verify rows fed them from the passes' own buffer."""
    spec = {"speculative_config": json.dumps({"method": "mtp", "num_speculative_tokens": k})} if k else {}
    with LLM(str(mtp_model), **KW, **spec, async_scheduling=ahead) as llm:
        rows, mtp = graph_path(llm, mtp=k > 0)
        ex = llm.engine.executor
        calls = []  # the steps that drafted
        fed = []  # the steps launched on drafts still on the device

        def count(*args: list, made: object) -> object:
            calls.append(bool(args[1]))
            return made(*args)  # type: ignore[operator]

        ex.draft = functools.partial(count, made=ex.draft)  # type: ignore[method-assign]
        ex.draft_ahead = functools.partial(count, made=ex.draft_ahead)  # type: ignore[method-assign]
        if k:
            feed = llm.engine.drafts.feed
            llm.engine.drafts.feed = lambda s: fed.append(feed(s)) or fed[-1]  # type: ignore[method-assign]
        outs = llm.generate(prompts(), GREEDY)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
        for o, r in zip(outs, reference):
            assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) < 1e-4
        assert rows.replays > 10 and rows.prefill_replays > 0  # decode steps, prefills (and verify steps) as rows
        if k:
            c = llm.engine.spec_counts
            assert c.steps > 0 and c.draft_tokens > 0
            assert rows.prefill_replays > rows.replays // 2  # the verify steps too, not run eagerly
            assert mtp is not None and mtp.replays == sum(calls) > 10  # every step's passes by their graphs
        assert (sum(f is not None for f in fed) > 10) == ahead and (llm.engine.ahead_steps > 10) == ahead
        assert llm.engine.num_used_blocks == 0 and llm.engine.scheduler.num_deferred == 0


@pytest.mark.parametrize("k,sizes", [(1, None), (3, None), (3, [1, 2, 4, 8, 16, 32, 64])],
                         ids=["k1", "k3", "k3-padded"])
def test_graph_passes_draft_what_eager_passes_draft(mtp_model: Path, k: int, sizes: list[int] | None) -> None:
    """After every step the MTP passes' graphs (their work on the replay's buffers) draft exactly the tokens the
    eager passes draft after the same replayed step: the two engines' drafts, request by request and step by
    step, are equal (so are their acceptance counts), with requests of different budgets (k = 3: some draft
    fewer tokens near max_tokens, and their rows run on in the later passes, writing to the spare block). With a
    ladder of powers of two (k3-padded) steps and drafting rows are padded to the next size: padding rows write to
    the spare block and are dropped."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (20, 7, 12, 5)]
    seen: list[list[list[list[int]]]] = []
    for mtp in (False, True):
        with LLM(str(mtp_model), speculative_config=json.dumps({"method": "mtp", "num_speculative_tokens": k}),
                 **KW) as llm:
            engine = llm.engine
            _, graphs = graph_path(llm, mtp, sizes)
            drafts: list[list[list[int]]] = []
            made = engine.executor.draft

            def record(*args: list, made: object = made, drafts: list = drafts) -> list[list[int]]:
                out = made(*args)  # type: ignore[operator]
                drafts.append(out)
                return out

            engine.executor.draft = record  # type: ignore[method-assign]
            llm.generate(prompts(), params)
            assert (graphs is not None and graphs.replays > 0) == mtp
            assert engine.num_used_blocks == 0
            seen.append(drafts)
    assert seen[0] == seen[1] and sum(len(d) for step in seen[0] for d in step) > 20


def test_right_drafts_verified_as_graph_rows_are_all_accepted(mtp_model: Path, reference: list) -> None:
    """Drafts from the known continuation (k = 3), verified as graph rows: all accepted, the same tokens."""
    from engine.speculative import draft_budget

    k = 3
    future = {tuple(p): r.token_ids for p, r in zip(prompts(), reference)}
    with LLM(str(mtp_model), speculative_config=json.dumps({"method": "mtp", "num_speculative_tokens": k}),
             **KW) as llm:
        engine = llm.engine
        rows = EagerRows(llm, max_rows=64)
        engine.executor.runner.graphs = rows

        def oracle(step: object, ahead: bool = False) -> None:
            for seq in engine.scheduler.running:
                if seq.num_remaining == 1:
                    done = len(seq.output_token_ids)
                    n = draft_budget(seq, k, engine.max_model_len)
                    seq.drafts = future[tuple(seq.prompt_token_ids)][done : done + n]

        engine._draft = oracle  # type: ignore[method-assign]
        outs = llm.generate(prompts(), GREEDY)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
        c = engine.spec_counts
        assert c.accepted_tokens == c.draft_tokens > 0 and c.mean_accepted_length > 3
        assert rows.prefill_replays > 0
        assert engine.num_used_blocks == 0
