"""Speculative decoding (the MTP layer) under expert parallelism across a decode node's DP replicas: two replica
engines, one process each, as one gloo EP group stepping in lockstep by waves (``decode_node.waves``), each
holding half the routed experts, the MTP layer's included. After every step each runs the MTP layer's passes,
its MoE dispatching over the group (``ModelRunner.draft``, ``ExpertGroup.pass_counts``): a replica without rows,
or without drafting requests, takes part in each pass with none.

The arrivals: one replica works while the other is idle for many steps, a request joins the idle one mid-wave,
a prompt longer than the graphs' rows, and a second wave with the other replica idle throughout. Greedy tokens
equal one engine with EP and MTP off (logprobs within fp32 rounding), for k = 1 and 2, with every step eager and
with the graph path (``ep_graph_targets.EagerLadder``: every replay run eagerly over the real ladder of sizes;
the MTP passes stay eager, their counts dynamic). Drafts are made and verified on both replicas; every block is
freed; each replica holds half the MTP layer's routed experts.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from ep_graph_targets import Arrival, Ran, Script, ep_graph_replica, record_drafts
from procs import rank_children

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.parallel.rank_group import RankGroup
from pdctl.tiny_model import make_tiny_model

ENGINE = dict(dtype="float32", device="cpu", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
              max_cudagraph_capture_size=16, num_kv_blocks=64)
SHORT = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
LONG = SamplingParams(max_tokens=30, temperature=0.0, logprobs=1, ignore_eos=True)
ARRIVALS = [
    Arrival(0, 0, "a", [(i * 7 + 3) % 1000 + 2 for i in range(40)], LONG),  # replica 1 idle until b, after b, d
    Arrival(6, 1, "b", [5, 9, 17, 33, 65], SHORT),  # joins mid-wave beside a's verify rows
    Arrival(9, 0, "c", [4, 8, 15], SHORT),
    Arrival(12, 1, "d", [(i * 11 + 5) % 1000 + 2 for i in range(20)], SHORT),  # 20 prompt rows: eager on both
    Arrival(60, 1, "e", [3, 1, 4, 1, 5, 9, 2, 6], SHORT),  # a new wave: replica 0 idle throughout
    Arrival(60, 1, "f", [2, 7, 1, 8], LONG),
]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("ep-mtp") / "v3-mtp", arch="v3", moe=True, seed=7, mtp_layers=1)


@pytest.fixture(scope="module")
def want(mtp_model: Path) -> dict[str, tuple[list[int], list[float]]]:
    """One engine, EP and MTP off, each request alone."""
    with LLM(str(mtp_model), **{k: v for k, v in ENGINE.items() if k != "max_cudagraph_capture_size"}) as llm:
        return {a.rid: (o.token_ids, o.logprobs) for a in ARRIVALS for o in llm.generate([a.prompt], a.params)}


def spec(k: int) -> str:
    return f'{{"method": "mtp", "num_speculative_tokens": {k}}}'


def drafted_alone(model: Path, k: int) -> dict[str, list[tuple[int, list[int]]]]:
    """One engine, EP off, MTP on: each request alone, its drafts after each step (as the replicas record)."""
    drafts: dict[str, list[tuple[int, list[int]]]] = {}
    engine = {k: v for k, v in ENGINE.items() if k != "max_cudagraph_capture_size"}
    with LLM(str(model), speculative_config=spec(k), **engine) as llm:
        e = llm.engine
        for a in ARRIVALS:
            seqs = {a.rid: e.add_request(a.prompt, a.params, request_id=a.rid)}
            while e.has_unfinished():
                e.step()
                record_drafts(seqs, drafts)
    return drafts


def run(model: Path, k: int, graphs: bool) -> list[Ran]:
    engine = {**ENGINE, "speculative_config": spec(k)}
    script = Script(str(model), engine, ARRIVALS, graphs=graphs)
    with RankGroup(ep_graph_replica, 2, [script, script], collective_timeout_s=60) as group:
        ran = [group.recv(r, 300) for r in range(2)]
    assert not rank_children()
    return ran


@pytest.mark.parametrize(("k", "graphs"), [(1, False), (2, False), (2, True)], ids=["k1", "k2", "k2-graphs"])
def test_ep_replicas_draft_with_the_mtp_layer_and_equal_decoding_without(mtp_model: Path, want, k: int,
                                                                        graphs: bool) -> None:
    ran = run(mtp_model, k, graphs)
    got = {**ran[0].outputs, **ran[1].outputs}
    assert sorted(got) == sorted(want)
    for rid, (ids, lps) in got.items():
        assert ids == want[rid][0], rid
        # The same products summed in another order (per choice, then over the group): fp32 rounding.
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(lps, want[rid][1])), rid
    r0, r1 = ran
    assert [r.used_blocks for r in ran] == [0, 0]
    # The MTP layer's passes over the group draft what it drafts without EP, request by request, step by step.
    assert {**r0.drafts, **r1.drafts} == drafted_alone(mtp_model, k)
    assert r0.steps == r1.steps  # lockstep
    # Drafts made and verified on both replicas (and, at k = 2, more than one per step somewhere).
    for r in ran:
        assert r.spec.steps > 0 and r.spec.draft_tokens >= r.spec.steps
    if k == 2:
        assert r0.spec.draft_tokens > r0.spec.steps or r1.spec.draft_tokens > r1.spec.steps
    # Each replica holds half the MTP layer's routed experts.
    experts = ModelConfig.from_pretrained(str(mtp_model)).n_routed_experts
    assert experts and [r.mtp_experts for r in ran] == [experts // 2] * 2
    if graphs:  # verify rows replayed in lockstep, a replica without rows padding
        assert r0.launched == r1.launched and r0.replays > 0 and r0.pad_replays > 0 and r1.pad_replays > 0
