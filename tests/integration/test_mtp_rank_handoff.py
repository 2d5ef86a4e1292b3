"""Speculative decoding's hand-off from a prefill engine on rank processes (``engine.speculative``: PCP2 with
sharded KV, PP2 x PCP2, PCP2 with expert parallelism, DP2 with expert parallelism across the replicas): the last
stage holds the MTP layer, and each of its PCP ranks runs it over its own rows of every step (under EP its MoE
dispatching over the EP group's ranks, each holding half the layer's routed experts; across DP replicas, which
step in lockstep, every replica's ranks run it after every step, rows or none).

Prompts are prefilled in 32-token chunks (one chunk; a last chunk of one row, which PCP runs as a decode row
on every rank; several) with their KV held, as a prefill node does. Their first token and the MTP layer's
draft equal the in-process (PCP1) prefill's, the KV they hold (the MTP layer's cache layer included) equals
PCP1's within fp32 rounding, and the ownership query puts the MTP layer's cache on the last stage only. A
decode engine with the MTP layer pulls the KV through Mooncake (the MTP layer's as an optional layer, as a
decode node does), verifies the prefill's draft at its first step, and decodes as one engine without
speculative decoding, token for token, for k = 1 and 2.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from engine_helpers import read_kv

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from engine.speculative import Drafts, draft_budget
from engine.weights import build_empty_model
from kv_transfer.handoff import KVReceiver
from kv_transfer.layout import CacheLayout, RequestKV
from kv_transfer.transport import register_cache
from kv_transfer.transports.mooncake import MooncakeExporter, MooncakeTransport
from pdctl.tiny_model import make_tiny_model

KW = dict(dtype="float32", device="cpu", max_model_len=512)
CHUNK = 32  # max_num_batched_tokens of the prefills
LENGTHS = (3, 17, 33, 70)
TOKENS = 24
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mtp-ranks") / "v3-mtp", arch="v3", moe=True, seed=7,
                           mtp_layers=1)


def spec(k: int) -> str:
    return json.dumps({"method": "mtp", "num_speculative_tokens": k})


def prompts() -> list[list[int]]:
    """Then one that begins with the last one's first four blocks: a prefix cache hit, whose last matched
    block is computed again (the MTP layer's KV there depends on the token after it), over a cached context."""
    g = torch.Generator().manual_seed(0)
    out = [torch.randint(4, 1000, (n,), generator=g).tolist() for n in LENGTHS]
    return out + [out[-1][:64] + torch.randint(4, 1000, (20,), generator=g).tolist()]


@dataclass
class Prefilled:
    first: int  # the first token
    drafts: list[int]  # the MTP layer's draft of the token after it
    kv: dict[int, torch.Tensor]  # layer -> [prompt tokens, L + R], the MTP layer's cache layer included


def _prefill(engine: LLMEngine) -> list[Prefilled]:
    """Every prompt prefilled as a prefill node runs it (one token, KV held as request "r{i}")."""
    out = []
    for i, prompt in enumerate(prompts()):
        seq = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id=f"r{i}",
                                 hold_kv=True)
        while not seq.is_finished:
            engine.step()
        out.append(Prefilled(seq.output_token_ids[0], list(seq.drafts), read_kv(engine, f"r{i}")))
    return out


@pytest.fixture(scope="module")
def reference(mtp_model: Path) -> list[list[int]]:
    """Greedy outputs of one engine without speculative decoding."""
    with LLM(str(mtp_model), **KW) as llm:
        return [o.token_ids for o in llm.generate(prompts(), GREEDY)]


@pytest.fixture(scope="module")
def pcp1(mtp_model: Path) -> list[Prefilled]:
    """The in-process prefill with the MTP layer (engine.speculative's own)."""
    with LLM(str(mtp_model), speculative_config=spec(1), max_num_batched_tokens=CHUNK, **KW) as llm:
        got = _prefill(llm.engine)
        for i in range(len(got)):
            assert llm.engine.release(f"r{i}")
        return got


def _decode(mtp_model: Path, k: int, prefill: LLMEngine, sources: dict[int, CacheLayout],
            held: list[Prefilled]) -> list[list[int]]:
    """Each held request pulled through Mooncake into a decode engine with the MTP layer (k drafts a step) and
    decoded there; returns the outputs."""
    with LLM(str(mtp_model), speculative_config=spec(k), **KW) as llm:
        de = llm.engine
        transport = MooncakeTransport()
        try:
            receiver = KVReceiver(transport, register_cache(transport, de.cache_layers), timeout_s=30,
                                  optional=de.mtp_layers)
            seqs = []
            for i, (prompt, p) in enumerate(zip(prompts(), held)):
                rid = f"r{i}"
                request = RequestKV(prefill.kv_ownership(rid), len(prefill.held[rid].block_ids))
                seq = de.begin_prefilled(prompt, GREEDY, request_id=rid)
                hit = seq.prefix_hit_blocks
                table = seq.block_ids[:hit] + receiver.pull_into(rid, request, sources, seq.block_ids[hit:])
                de.admit_prefilled(seq, table, p.first, drafts=p.drafts)
                assert seq.drafts == p.drafts  # verified at its first step
                got = read_kv(de, rid)
                assert sorted(got) == sorted(p.kv)  # the MTP layer's cache moved with the stack's
                for layer, t in p.kv.items():
                    assert torch.equal(got[layer], t), f"layer {layer} differs after the transfer"
                seqs.append(seq)
            de.step()  # the first decode step: each request verifies the prefill's draft in it
            assert de.spec_counts.steps == len(seqs)
            while de.has_unfinished():
                de.step()
            assert de.num_used_blocks == 0
            assert de.spec_counts.steps >= len(seqs) * (TOKENS - 2) // (k + 1)  # it drafted on
            return [s.output_token_ids for s in seqs]
        finally:
            transport.close()


@pytest.mark.parametrize("topology", [dict(pcp=2), dict(pcp=2, pp=2), dict(pcp=2, enable_expert_parallel=True)],
                         ids=["pcp2", "pp2-pcp2", "pcp2-ep2"])
def test_a_prefill_on_rank_processes_hands_off_the_mtp_layers_draft_and_kv(
        mtp_model: Path, reference: list[list[int]], pcp1: list[Prefilled], in_process_drafts: dict,
        topology: dict[str, int]) -> None:
    with LLM(str(mtp_model), speculative_config=spec(2), cache_exporter=MooncakeExporter(),
             max_num_batched_tokens=CHUNK, kv_layout="sharded", **topology, **KW) as prefill:
        pe = prefill.engine
        n = pe.model_config.num_hidden_layers
        if topology.get("enable_expert_parallel"):  # each PCP rank holds half the routed experts, the MTP layer's too
            whole = build_empty_model(pe.model_config, torch.float32, torch.device("cpu"), mtp=True)
            assert prefill.node is not None and prefill.node.expert_params == [whole.routed_expert_params() // 2] * 2
        held = _prefill(pe)
        for i, (mine, ref) in enumerate(zip(held, pcp1)):
            assert mine.first == ref.first
            assert len(ref.drafts) == 1 and mine.drafts == ref.drafts, f"prompt {i}"
            assert sorted(mine.kv) == sorted(ref.kv) == list(range(n + 1))  # n: the MTP layer's cache
            for layer, t in ref.kv.items():
                assert not mine.kv[layer].isnan().any(), f"layer {layer}: a position is held by no rank"
                torch.testing.assert_close(mine.kv[layer], t, atol=1e-5, rtol=0)
        last = topology.get("pp", 1) - 1
        for rb in pe.kv_ownership("r3"):
            assert (n in rb.layers) == (rb.pp == last)
            assert rb.physical  # sharded: every PCP rank holds some of a 70-token prompt's blocks
        for k in (1, 2):
            assert _decode(mtp_model, k, pe, prefill.cache_exports, held) == reference, f"k={k}"
        assert pe.prefix_cache is not None and pe.prefix_cache.hits == 3  # the last prompt's (one spared)
        for i in range(len(held)):
            assert pe.release(f"r{i}")
        assert pe.num_used_blocks == 0
        # Requests that go on decoding on the ranks draft there too, over the held prompts' cached blocks.
        steps = pe.spec_counts.steps
        assert [o.token_ids for o in prefill.generate(prompts(), GREEDY)] == reference
        assert pe.spec_counts.steps > steps and pe.num_used_blocks == 0
        # The same start serves test_requests_decoding_on_rank_processes_verify_drafts' checks at k = 2.
        pe.prefix_cache.reset()
        _decoding_on_ranks_verifies_drafts(prefill, 2, reference, in_process_drafts)


def test_dp_replicas_with_expert_parallelism_across_them_hand_off_the_mtp_layers_draft_and_kv(
        mtp_model: Path, reference: list[list[int]], pcp1: list[Prefilled], in_process_drafts: dict) -> None:
    """DP2 with EP across the replicas: the prompts split over the two replicas (one has more, so it steps alone
    at times while the other's ranks run the steps' and the MTP passes' collectives without rows), stepped as a
    prefill node steps them (every replica's step finished, then the drafts settled: asked for one replica at a
    time and awaited at once, the MTP pass of one replica's ranks would wait for the other's). Each request's
    first token, draft and KV (the MTP layer's included) equal the in-process prefill's; decoding on the ranks
    (drafting there too) equals one engine's."""
    with LLM(str(mtp_model), speculative_config=spec(2), max_num_batched_tokens=CHUNK, dp=2,
             enable_expert_parallel=True, **KW) as prefill:
        whole = build_empty_model(prefill.engine.model_config, torch.float32, torch.device("cpu"), mtp=True)
        assert prefill.node is not None and prefill.node.expert_params == [whole.routed_expert_params() // 2] * 2
        assert all(e.lockstep and e.drafts is not None and e.drafts.deferred for e in prefill.engines)
        on = [prefill.engines[0 if i < 4 else 1] for i in range(len(prompts()))]  # replica 1: the last prompt
        seqs = [e.add_request(p, SamplingParams(max_tokens=1, temperature=0.0), request_id=f"r{i}", hold_kv=True)
                for i, (e, p) in enumerate(zip(on, prompts()))]
        while busy := prefill.to_step():
            for e in busy:
                e.launch_step()
            for e in busy:
                e.finish_step()
            for e in busy:
                e.settle_drafts()
        for i, (e, seq, ref) in enumerate(zip(on, seqs, pcp1)):
            assert seq.output_token_ids == [ref.first], f"prompt {i}"
            assert len(ref.drafts) == 1 and seq.drafts == ref.drafts, f"prompt {i}"
            got = read_kv(e, f"r{i}")
            assert sorted(got) == sorted(ref.kv)
            for layer, t in ref.kv.items():
                torch.testing.assert_close(got[layer], t, atol=1e-5, rtol=0)
            assert e.release(f"r{i}")
        assert all(e.num_used_blocks == 0 for e in prefill.engines)
        assert [o.token_ids for o in prefill.generate(prompts(), GREEDY)] == reference
        # The same start serves test_requests_decoding_on_rank_processes_verify_drafts' checks at k = 2.
        for e in prefill.engines:
            assert e.prefix_cache is not None
            e.prefix_cache.reset()
        _decoding_on_ranks_verifies_drafts(prefill, 2, reference, in_process_drafts)


def _record_drafts(engines: list[LLMEngine]) -> dict[tuple[int, ...], list[list[int]]]:
    """Each request's drafts after every step it drafted at, by prompt (filled as the engines run; deferred
    drafts once they are settled)."""
    log: dict[tuple[int, ...], list[list[int]]] = {}

    def note(seqs: list) -> None:
        for seq in seqs:
            if seq.drafts:
                log.setdefault(tuple(seq.prompt_token_ids), []).append(list(seq.drafts))

    for e in engines:
        assert e.drafts is not None
        drafts, draft, settle = e.drafts, e.drafts.draft, e.drafts.settle

        def record(scheduled: list, starts: list[int], ahead: bool = False, draft: Callable = draft) -> None:
            draft(scheduled, starts, ahead)
            note([s.seq for s in scheduled])

        def record_settled(drafts: Drafts = drafts, settle: Callable = settle) -> None:
            asked = drafts._asked or []
            settle()
            note(asked)

        drafts.draft = record  # type: ignore[method-assign]
        drafts.settle = record_settled  # type: ignore[method-assign]
    return log


@pytest.fixture(scope="module")
def in_process_drafts(mtp_model: Path) -> dict[int, dict[tuple[int, ...], list[list[int]]]]:
    """The drafts one engine in this process makes for the prompts, at k = 1 and 2."""
    out = {}
    for k in (1, 2):
        with LLM(str(mtp_model), speculative_config=spec(k), max_num_batched_tokens=CHUNK, **KW) as llm:
            out[k] = _record_drafts(llm.engines)
            llm.generate(prompts(), GREEDY)
    return out


# The hand-off tests' starts (k = 2: PCP2, PP2 x PCP2, PCP2 with EP2, DP2 with EP2) run these checks too.
@pytest.mark.parametrize("k,topology", [
    (1, dict(pcp=2, kv_layout="sharded")), (1, dict(dp=2, enable_expert_parallel=True)),
    (2, dict(dp=2, pcp=2, kv_layout="sharded", enable_expert_parallel=True)),
], ids=["pcp2-k1", "dp2-ep2-k1", "dp2-pcp2-ep4-k2"])
def test_requests_decoding_on_rank_processes_verify_drafts(
        mtp_model: Path, reference: list[list[int]], in_process_drafts: dict, k: int, topology: dict) -> None:
    with LLM(str(mtp_model), speculative_config=spec(k), max_num_batched_tokens=CHUNK, **topology, **KW) as llm:
        _decoding_on_ranks_verifies_drafts(llm, k, reference, in_process_drafts)


def _decoding_on_ranks_verifies_drafts(llm: LLM, k: int, reference: list[list[int]], in_process_drafts: dict) -> None:
    """Requests that go on decoding on the ranks draft at every step (the MTP layer's pass over the step's rows,
    ``RunDraft``, picks the last accepted row; at k = 2 the ranks run it once more, a decode row a request over the
    layer's sharded cache) and verify the drafts in the next one, their rows a chunk of the request split over
    the PCP ranks like a prompt's; across DP replicas with EP the drafts are settled once every replica's step
    is done (at k = 2 a replica whose requests draft less, or none, runs the further pass's collectives for the
    other's). Greedy outputs equal one engine's without drafts, token for token (the prompts: one hitting the
    prefix cache), the drafts equal those one engine in this process makes, and every block is freed. The random
    model's drafts are seldom right, so the requests decode again with drafts from the reference's continuation:
    each verify step's rows after an accepted draft must come from the ranks right too.

    ``llm``'s prefix cache must hold none of the prompts' blocks (a fresh one, or one ``reset``)."""
    drafted = _record_drafts(llm.engines)
    steps = sum(e.spec_counts.steps for e in llm.engines)
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == reference
    assert sum(e.spec_counts.steps for e in llm.engines) - steps >= len(prompts()) * (TOKENS - 2) // (k + 1)
    assert drafted == in_process_drafts[k]
    assert any(len(d) == k for runs in drafted.values() for d in runs)
    future = {tuple(p): out for p, out in zip(prompts(), reference)}

    def oracle(engine: LLMEngine) -> Callable[[object], None]:
        def draft(step: object, ahead: bool = False) -> None:
            for seq in engine.scheduler.running:
                if seq.num_remaining == 1:
                    n = draft_budget(seq, k, engine.max_model_len)
                    seq.drafts = future[tuple(seq.prompt_token_ids)][len(seq.output_token_ids):][:n]
        return draft

    for e in llm.engines:
        e._draft = oracle(e)  # type: ignore[method-assign]
    before = sum(e.spec_counts.accepted_tokens for e in llm.engines)
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == reference
    accepted = sum(e.spec_counts.accepted_tokens for e in llm.engines) - before
    assert accepted >= len(prompts()) * (TOKENS - 4) * k // (k + 1)  # most tokens from a draft
    assert all(e.num_used_blocks == 0 for e in llm.engines)
