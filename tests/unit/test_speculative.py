"""Speculative decoding with the MTP layer (``engine.speculative``) in the in-process engine: greedy outputs
equal decoding without it token for token, whatever the drafts (the model's own, all right, all wrong),
with sampled requests beside them, under preemption and after aborts; every block is freed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from engine.sequence import Sequence
from engine.speculative import SpecCounts, SpeculativeConfig, accepted, draft_budget
from pdctl.tiny_model import make_tiny_model

KW = dict(dtype="float32", device="cpu", max_model_len=512)
LENGTHS = (3, 17, 40, 70)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("spec") / "v3-mtp", arch="v3", moe=True, seed=7, mtp_layers=1)


def spec(k: int) -> str:
    return json.dumps({"method": "mtp", "num_speculative_tokens": k})


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 1000, (n,), generator=g).tolist() for n in LENGTHS]


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(mtp_model: Path) -> list[list[int]]:
    """Greedy outputs without speculative decoding."""
    with LLM(str(mtp_model), **KW) as llm:
        return [o.token_ids for o in llm.generate(prompts(), GREEDY)]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_with_the_mtp_layers_drafts_equals_without(mtp_model: Path, reference: list[list[int]],
                                                          k: int) -> None:
    with LLM(str(mtp_model), speculative_config=spec(k), **KW) as llm:
        outs = llm.generate(prompts(), GREEDY)
        counts = llm.engine.spec_counts
        assert [o.token_ids for o in outs] == reference
        assert counts.steps > 0 and counts.draft_tokens > 0  # it drafted and verified
        assert counts.draft_tokens <= counts.steps * k
        assert llm.engine.num_used_blocks == 0


SHARED = [(i * 13 + 7) % 1000 + 2 for i in range(32)]  # two full blocks two prompts begin with


@pytest.mark.parametrize("k,shared", [(1, False), (3, False), (2, True)], ids=["k1", "k3", "k2-shared-prefix"])
def test_every_first_draft_is_the_plain_mtp_references_prediction(mtp_model: Path, reference: list[list[int]],
                                                                  k: int, shared: bool) -> None:
    """The MTP layer's KV builds up right through prompt chunks and verify steps with rejected rows: each
    first draft, made after position q, equals the reference MTP layer's argmax at q over the whole final
    sequence (tests/unit/test_mtp_layer.py's reference). With prompts sharing two full blocks, the second
    one's prefix cache hit leaves the last shared block to be recomputed (its last position's MTP KV
    depends on the token after it)."""
    from test_mtp_layer import reference_mtp_logits

    made: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    batch = [SHARED + p for p in prompts()[:2]] if shared else prompts()
    with LLM(str(mtp_model), speculative_config=spec(k), max_num_batched_tokens=32, **KW) as llm:
        engine = llm.engine
        draft = engine._draft

        def recording(step: object, ahead: bool = False) -> None:
            draft(step, ahead)
            for seq in engine.scheduler.running:
                if seq.drafts:
                    made.setdefault(tuple(seq.prompt_token_ids), []).append((seq.num_computed - 1, seq.drafts[0]))

        engine._draft = recording  # type: ignore[method-assign]
        if shared:
            outs = [llm.generate([p], GREEDY)[0] for p in batch]  # one after the other: the second hits the cache
            assert engine.scheduler.prefix is not None and engine.scheduler.prefix.hits == 1  # 2 matched, 1 spared
        else:
            outs = llm.generate(batch, GREEDY)
    if not shared:
        assert [o.token_ids for o in outs] == reference
    for p, out in zip(batch, [o.token_ids for o in outs]):
        tokens = p + out
        ref = reference_mtp_logits(mtp_model, tokens[:-1], tokens[1:]).argmax(-1).tolist()
        drafts = made[tuple(p)]
        assert len(drafts) >= len(out) // (k + 1)
        assert [d for _, d in drafts] == [ref[q] for q, _ in drafts], p[:3]


class Oracle:
    """Drafts made from the known greedy continuation: right ones, or each one wrong."""

    def __init__(self, engine: LLMEngine, reference: dict[tuple[int, ...], list[int]], k: int, wrong: bool) -> None:
        self.engine, self.reference, self.k, self.wrong = engine, reference, k, wrong

    def __call__(self, step: object, ahead: bool = False) -> None:
        for seq in self.engine.scheduler.running:
            if seq.num_remaining != 1:
                continue
            n = draft_budget(seq, self.k, self.engine.max_model_len)
            done = len(seq.output_token_ids)
            future = self.reference[tuple(seq.prompt_token_ids)][done : done + n]
            seq.drafts = self.wrong_drafts(seq, done, future) if self.wrong else future

    def wrong_drafts(self, seq: Sequence, done: int, future: list[int]) -> list[int]:
        """Drafts each unlike the continuation's token at its place."""
        return [(t + 1) % 1000 for t in future]


@pytest.mark.parametrize("wrong", [False, True], ids=["all-right", "all-wrong"])
def test_right_drafts_are_all_accepted_and_wrong_ones_all_rejected(
        mtp_model: Path, reference: list[list[int]], wrong: bool) -> None:
    k = 3
    with LLM(str(mtp_model), speculative_config=spec(k), **KW) as llm:
        engine = llm.engine
        engine._draft = Oracle(engine, {tuple(p): r for p, r in zip(prompts(), reference)}, k, wrong)  # type: ignore
        outs = llm.generate(prompts(), GREEDY)
        assert [o.token_ids for o in outs] == reference
        c = engine.spec_counts
        if wrong:
            assert c.accepted_tokens == 0 and c.mean_accepted_length == 1.0
        else:
            assert c.accepted_tokens == c.draft_tokens > 0
            # each verify step gives its k drafts and the bonus: 24 tokens in about 24 / (k + 1) steps each
            assert c.mean_accepted_length > 3
        assert engine.num_used_blocks == 0


def test_logprobs_with_drafts_and_penalised_requests_beside_them_equal_decoding_without(
        mtp_model: Path, reference: list[list[int]]) -> None:
    """A request asking for logprobs drafts, its tokens' logprobs and top logprobs from their rows as without
    drafts; a penalised one beside it drafts too (tests/unit/test_speculative_penalties.py)."""
    with_lp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    penalised = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=0.5)
    params = [GREEDY, with_lp, GREEDY, penalised]
    with LLM(str(mtp_model), **KW) as llm:
        want = llm.generate(prompts(), params)
    with LLM(str(mtp_model), speculative_config=spec(2), **KW) as llm:
        got = llm.generate(prompts(), params)
        assert llm.engine.spec_counts.steps > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[1].logprobs == pytest.approx(want[1].logprobs, abs=1e-4)
    seq_want, seq_got = want[1], got[1]
    assert [sorted(t) for t in seq_got.top_logprobs] == [sorted(t) for t in seq_want.top_logprobs]
    assert want[0].token_ids == reference[0] and want[2].token_ids == reference[2]


def test_seeded_sampled_requests_draft_and_stay_reproducible(mtp_model: Path) -> None:
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    runs = []
    for _ in range(2):
        with LLM(str(mtp_model), speculative_config=spec(2), **KW) as llm:
            runs.append([o.token_ids for o in llm.generate(prompts(), sampled)])
            assert llm.engine.spec_counts.draft_tokens > 0
    assert runs[0] == runs[1]


def test_preempted_and_aborted_requests_free_every_block(mtp_model: Path, reference: list[list[int]]) -> None:
    # 12 blocks of 16: the four requests cannot all hold their prompts and drafts at once
    with LLM(str(mtp_model), speculative_config=spec(3), num_kv_blocks=12, **{**KW, "max_model_len": 128}) as llm:
        outs = llm.generate(prompts(), GREEDY)
        assert [o.token_ids for o in outs] == reference
        assert llm.engine.scheduler.preemptions > 0
        engine = llm.engine
        seqs = [engine.add_request(p, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
                for p in prompts(1)[:2]]
        while not any(s.drafts for s in seqs):
            engine.step()
        engine.step()  # a verify step
        for s in seqs:
            engine.abort(s.request_id)
        assert engine.num_used_blocks == 0 and not engine.has_unfinished()


def test_the_config_and_the_acceptance_rule() -> None:
    assert SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 2}').num_speculative_tokens == 2
    for bad in ('{"method": "eagle"}', '{"method": "mtp", "num_speculative_tokens": 0}', "mtp",
                '{"method": "mtp", "k": 1}', '{"method": "mtp", "num_speculative_tokens": true}'):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)
    assert accepted([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted([5, 6], [4, 6, 1]) == 0
    assert accepted([5, 6], [5, 6, 8]) == 2


def test_a_model_without_an_mtp_layer_is_refused(tmp_path: Path) -> None:
    plain = make_tiny_model(tmp_path / "plain", arch="v3", moe=True, seed=7)
    with pytest.raises(ValueError, match="no multi-token prediction layer"):
        LLM(str(plain), speculative_config=spec(1), **KW)


def _disaggregated(mtp_model: Path, prefill_spec: bool, decode_spec: bool,
                   record: list[tuple[tuple[int, ...], int, int]] | None = None, k: int = 2,
                   recompute: bool = True, ahead: bool = False) -> tuple[list[list[int]], SpecCounts]:
    """Each prompt prefilled on one engine (a prefill node's way: one token, KV held) and decoded on another
    (``begin_prefilled`` / ``admit_prefilled`` with the prefill side's drafts), the KV copied between their
    caches: every layer both hold (the MTP layer's when both do), as a transfer moves it. A decode side with
    the MTP layer and ``recompute`` (``mtp_recompute``) fed by a prefill side without it pulls nothing: its
    blocks are filled with noise, and it computes the prompts again. ``ahead``: the decode side launches each
    step ahead, right after the drafts of the one before (``async_scheduling``, as on a GPU)."""

    kw = dict(speculative_config=spec(k))
    recomputes = decode_spec and not prefill_spec and recompute
    with LLM(str(mtp_model), **(kw if prefill_spec else {}), **KW) as p_llm:
        d_llm = LLM(str(mtp_model), **(dict(kw, mtp_recompute=recompute) if decode_spec else {}),
                    async_scheduling=ahead, **KW)
        p_eng, d_eng = p_llm.engine, d_llm.engine
        if record is not None:
            draft, land = d_eng._draft, d_eng._land

            def note() -> None:
                for q in d_eng.scheduler.running:
                    if q.drafts:
                        record.append((tuple(q.prompt_token_ids), q.num_computed - 1, q.drafts[0]))

            def recording(step: object, ahead: bool = False) -> None:
                draft(step, ahead)
                if not (d_eng.drafts and d_eng.drafts.in_flight):  # else once they land (the next step launched)
                    note()

            def landing(step: object) -> None:
                flying = d_eng.drafts is not None and d_eng.drafts.in_flight
                land(step)
                if flying:
                    note()

            d_eng._draft = recording  # type: ignore[method-assign]
            d_eng._land = landing  # type: ignore[method-assign]
        layers = sorted(set(p_eng.cache_layers) & set(d_eng.cache_layers))
        seqs = []
        for i, prompt in enumerate(prompts()):
            held = p_eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id=f"r{i}",
                                     hold_kv=True)
            while not held.is_finished:
                p_eng.step()

            def fill(block_ids: list[int], src: list[int] = held.block_ids) -> list[int]:
                for layer, cache in d_eng.cache_layers.items():
                    if recomputes:  # nothing pulled: whatever the blocks held
                        cache[block_ids] = torch.randn_like(cache[block_ids])
                    elif layer in layers:
                        cache[block_ids] = p_eng.cache_layers[layer][src]
                return block_ids

            seq = d_eng.begin_prefilled(prompt, GREEDY, request_id=f"r{i}")
            hit = seq.prefix_hit_blocks
            d_eng.admit_prefilled(seq, seq.block_ids[:hit] + fill(seq.block_ids[hit:]), held.output_token_ids[0],
                                  drafts=list(held.drafts) if p_eng.mtp_layers <= set(layers) else None)
            if prefill_spec and decode_spec:  # the prefill side's draft, verified at the first step
                assert held.drafts and seq.drafts == held.drafts[:1]
            assert p_eng.release(f"r{i}")
            seqs.append(seq)
        # The first decode step: each request verifies the prefill side's draft in it, or computes its prompt
        # again (and the first token); then all draft.
        d_eng.step()
        assert d_eng.spec_counts.steps == (len(seqs) if prefill_spec and decode_spec else 0)
        assert all(bool(s.drafts) == (prefill_spec and decode_spec or recomputes) for s in seqs)
        while d_eng.has_unfinished():
            d_eng.step()
        outs = [s.output_token_ids for s in seqs]
        assert p_eng.num_used_blocks == 0 and d_eng.num_used_blocks == 0 and d_eng.scheduler.num_deferred == 0
        assert (d_eng.ahead_steps > 10) == (ahead and decode_spec)
        counts = d_eng.spec_counts
    d_llm.shutdown()
    return outs, counts


@pytest.mark.parametrize("prefill_spec,decode_spec,ahead", [(True, True, False), (True, True, True),
                                                            (False, True, False), (True, False, False)],
                         ids=["both", "both-ahead", "decode-only-no-recompute", "prefill-only"])
def test_a_transferred_request_drafts_from_its_first_step_when_both_sides_run_mtp(
        mtp_model: Path, reference: list[list[int]], prefill_spec: bool, decode_spec: bool, ahead: bool) -> None:
    """Both sides with the MTP layer: the prefill side's draft and the MTP layer's KV of the prompt travel,
    the decode side verifies that draft at its first step, and every later draft equals the plain MTP
    reference's (so the transferred MTP KV is right). A prefill side without it and ``mtp_recompute`` off:
    the decode side does not draft for the request. A decode side without it: it takes the stack's layers
    only. Outputs equal decoding in one engine, every time."""
    from test_mtp_layer import reference_mtp_logits

    made: list[tuple[tuple[int, ...], int, int]] = []
    outs, counts = _disaggregated(mtp_model, prefill_spec, decode_spec, made, recompute=False, ahead=ahead)
    assert outs == reference
    if prefill_spec and decode_spec:
        assert counts.steps >= len(prompts()) * (24 // 3)  # every step of every request verified drafts
        for p, out in zip(prompts(), reference):
            tokens = p + out
            ref = reference_mtp_logits(mtp_model, tokens[:-1], tokens[1:]).argmax(-1).tolist()
            mine = [(q, d) for key, q, d in made if key == tuple(p)]
            assert mine and [d for _, d in mine] == [ref[q] for q, _ in mine]
    else:
        assert counts.steps == 0


@pytest.mark.parametrize("k", [1, 2])
def test_a_decode_side_with_mtp_computes_the_mtp_kv_itself_when_the_prefill_side_has_none(
        mtp_model: Path, reference: list[list[int]], k: int) -> None:
    """A prefill side without the MTP layer, a decode side with it (``mtp_recompute``, the default): the
    decode side computes each prompt and its first token again in the request's blocks (noise: nothing was
    pulled), drafts from the step after, and every draft equals the plain MTP reference's (so the MTP KV it
    computed is right). Outputs equal decoding in one engine."""
    from test_mtp_layer import reference_mtp_logits

    made: list[tuple[tuple[int, ...], int, int]] = []
    outs, counts = _disaggregated(mtp_model, False, True, made, k=k)
    assert outs == reference
    assert counts.steps >= len(prompts()) * ((24 - 2) // (k + 1))  # every step after the recompute verified
    for p, out in zip(prompts(), reference):
        tokens = p + out
        ref = reference_mtp_logits(mtp_model, tokens[:-1], tokens[1:]).argmax(-1).tolist()
        mine = [(q, d) for key, q, d in made if key == tuple(p)]
        assert mine[0][0] == len(p)  # the first draft: after the first token, right after the recompute
        assert [d for _, d in mine] == [ref[q] for q, _ in mine]


def _admit_without_mtp_kv(engine: LLMEngine, prompt: list[int], first: int, params: SamplingParams,
                          rid: str) -> Sequence:
    """A transferred request whose KV lacks the MTP layer's (nothing pulled: its blocks as they are)."""
    seq = engine.begin_prefilled(prompt, params, request_id=rid)
    assert not engine.admit_prefilled(seq, list(seq.block_ids), first)
    return seq


def test_a_recomputed_request_keeps_its_first_token_reuses_cached_blocks_and_frees_every_block(
        mtp_model: Path) -> None:
    """The recompute keeps the prefill side's first token as the first output of a seeded sampled request
    (one the model would hardly sample), starts after the blocks the decode side's prefix cache holds (its
    MTP KV right: every draft equals the reference's), and frees every block, at the end and when aborted
    mid-recompute (chunked: 32 tokens a step)."""
    from test_mtp_layer import reference_mtp_logits

    a, b = SHARED + prompts()[0], SHARED + prompts()[1]
    with LLM(str(mtp_model), **KW) as plain:
        want_b = plain.generate([b], GREEDY)[0].token_ids
    with LLM(str(mtp_model), speculative_config=spec(2), max_num_batched_tokens=32, **KW) as llm:
        engine = llm.engine
        made: list[tuple[int, int]] = []
        draft = engine._draft

        def recording(step: object, ahead: bool = False) -> None:
            draft(step, ahead)
            made.extend((q.num_computed - 1, q.drafts[0]) for q in engine.scheduler.running
                        if q.request_id == "b" and q.drafts)

        engine._draft = recording  # type: ignore[method-assign]
        llm.generate([a], SamplingParams(max_tokens=2, temperature=0.0))  # a's blocks: cached, with MTP KV
        seq = _admit_without_mtp_kv(engine, b, want_b[0], GREEDY, "b")
        assert seq.prefix_hit_blocks == 1 and seq.num_computed == 16  # 2 shared, the last spared
        while engine.has_unfinished():
            engine.step()
        assert seq.output_token_ids == want_b and engine.spec_counts.steps > 0
        ref = reference_mtp_logits(mtp_model, (b + want_b)[:-1], (b + want_b)[1:]).argmax(-1).tolist()
        assert made[0][0] == len(b) and [d for _, d in made] == [ref[q] for q, _ in made]

        steps = engine.spec_counts.steps
        sampled = SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True)
        seq = _admit_without_mtp_kv(engine, prompts()[2], 999, sampled, "s")
        while engine.has_unfinished():
            engine.step()
        assert seq.output_token_ids[0] == 999 and len(seq.output_token_ids) == 12
        assert engine.spec_counts.steps > steps

        seq = _admit_without_mtp_kv(engine, prompts()[3], 5, GREEDY, "x")  # 70 tokens: three chunks
        engine.step()
        assert 0 < seq.num_computed < len(prompts()[3])
        assert engine.abort("x")
        assert engine.num_used_blocks == 0 and not engine.has_unfinished()


def test_pdctl_route_says_what_speculative_decoding_does_on_a_route() -> None:
    from cluster.nodes import NodeInfo, NodeState
    from proxy.admin import speculative_pairing

    def node(node_id: str, role: str, k: int, recompute: bool = False) -> NodeState:
        return NodeState(NodeInfo(node_id=node_id, role=role, address="a:1", model="m", max_model_len=64, dp=1, pcp=1,
                                  pp=1, kv_layout="sharded", block_size=16, num_blocks=8, started_at=0.0,
                                  speculative_tokens=k, mtp_recompute=recompute))

    nodes = [node("p-on", "prefill", 2), node("p-off", "prefill", 0), node("d-on", "decode", 2),
             node("d-off", "decode", 0), node("d-re", "decode", 2, recompute=True)]
    assert speculative_pairing(nodes, "p-off", "d-off") is None
    assert "p-on's draft and MTP KV travel" in speculative_pairing(nodes, "p-on", "d-on")
    assert "p-on's draft and MTP KV travel" in speculative_pairing(nodes, "p-on", "d-re")
    assert "decodes without drafts" in speculative_pairing(nodes, "p-off", "d-on")
    assert ("p-off does not: d-re computes the MTP layer's KV itself (it prefills the prompt again"
            in speculative_pairing(nodes, "p-off", "d-re"))
    assert "the draft goes unused" in speculative_pairing(nodes, "p-on", "d-off")
    assert "prefilled on d-on" in speculative_pairing(nodes, None, "d-on")


@pytest.fixture(scope="module")
def trained(trained_mtp) -> Path:  # tests/unit/conftest.py's Trained
    """A tiny model whose MTP layer learned the corpus (some drafts hold, some do not)."""
    return trained_mtp.model


@pytest.mark.parametrize("penalties", [{}, dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.5)],
                         ids=["plain", "penalised"])
def test_rejection_sampling_keeps_the_targets_distribution(trained: Path, penalties: dict[str, float]) -> None:
    """Sampled at temperature 1.3 (top-p 0.95), 600 seeded requests with MTP drafts (k = 2) and 600 without, from a
    prompt the model did not train on: the
    first three tokens' distributions are one distribution by Pearson's chi-square test of homogeneity
    (scipy's chi2_contingency; categories with fewer than 10 samples in all pooled; p > 0.001 at each
    position and for the first two tokens jointly), while drafts were both accepted and rejected. Penalised
    requests too (each verify row's distribution penalised with the drafts before it)."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    from pdctl.train_tiny import corpus_ids

    prompt = corpus_ids(trained, held_out=True)[0][:16]
    n = 600

    def samples(seed0: int, **kw: object) -> list[list[int]]:
        params = [SamplingParams(max_tokens=4, temperature=1.3, top_p=0.95, seed=seed0 + i, ignore_eos=True,
                                 **penalties) for i in range(n)]  # type: ignore[arg-type]
        with LLM(str(trained), max_num_seqs=128, **kw, **KW) as llm:
            outs = [o.token_ids for o in llm.generate([prompt] * n, params)]
            if kw:
                c = llm.engine.spec_counts
                assert 0 < c.accepted_tokens < c.draft_tokens  # both branches ran
        return outs

    with_mtp, without = samples(0, speculative_config=spec(2)), samples(100_000)
    for name, key in (("token 1", lambda o: o[0]), ("token 2", lambda o: o[1]), ("token 3", lambda o: o[2]),
                      ("tokens 1-2", lambda o: (o[0], o[1]))):
        a, b = Counter(map(key, with_mtp)), Counter(map(key, without))
        common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
        table = [[a[t] for t in common] + [n - sum(a[t] for t in common)],
                 [b[t] for t in common] + [n - sum(b[t] for t in common)]]
        if table[0][-1] + table[1][-1] == 0:
            table = [row[:-1] for row in table]
        if len(table[0]) < 2:
            continue  # one outcome only: nothing to compare
        assert chi2_contingency(table).pvalue > 1e-3, (name, table)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-rows"])
def test_drafts_fed_from_the_device_to_a_step_launched_ahead_are_the_right_ones(
        mtp_model: Path, reference: list[list[int]], graphs: bool) -> None:
    """Steps launched ahead (``async_scheduling``) on drafts still on the device: each verify row reads its own
    draft from where the MTP passes left them (``Drafts.feed``). The drafts in flight are made the greedy
    continuation's (written over the passes' output, as the passes would have made them), so every one is
    accepted and its row's KV kept: the outputs equal decoding without drafts, eagerly and through the graph path's
    buffers (test_graph_rows_spec.py's stand-ins: the passes' output buffer itself), every draft accepted, and
    nothing left deferred. A row fed another draft of its request, or none, breaks both."""
    from test_graph_rows_spec import KW as ROWS_KW
    from test_graph_rows_spec import graph_path

    k = 3
    future = {tuple(p): r for p, r in zip(prompts(), reference)}
    with LLM(str(mtp_model), speculative_config=spec(k), async_scheduling=True,
             **(dict(ROWS_KW, max_model_len=512) if graphs else KW)) as llm:
        engine = llm.engine
        passes = graph_path(llm, mtp=True)[1] if graphs else None
        drafts = engine.drafts
        assert drafts is not None
        draft, fed = drafts.draft, []

        def right(scheduled: list, starts: list[int], ahead: bool = False) -> None:
            draft(scheduled, starts, ahead)
            if drafts._flight is None:
                return
            seqs, flight = drafts._flight
            fed.append(flight)
            for i, q in enumerate(seqs):
                done = len(q.output_token_ids)
                good = future[tuple(q.prompt_token_ids)][done : done + flight.lengths[i]]
                with torch.inference_mode():  # (the graph path lands what is there then: written once)
                    flight.tokens[i, : len(good)] = torch.tensor(good)
                if flight.known is not None:  # (eager passes brought their drafts to the host as they went)
                    flight.known[i] = good

        drafts.draft = right  # type: ignore[method-assign]
        outs = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
        c = engine.spec_counts
        assert len(fed) > 4 and c.accepted_tokens == c.draft_tokens and c.mean_accepted_length > 3
        assert all((f.known is None) == graphs for f in fed)  # the graph path's drafts landed from its buffer
        assert passes is None or passes.replays >= len(fed)
        assert engine.num_used_blocks == 0 and engine.scheduler.num_deferred == 0
    assert outs == reference
