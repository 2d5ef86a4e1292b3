"""CUDA graphs under expert parallelism, assembled on CPU: a decode node's two replicas as one gloo EP group,
each engine's steps going through the graph path (``ModelRunner._run_ep``, ``DecodeGraphs``) with every replay
run eagerly (``ep_graph_targets.EagerLadder``: the real ladder of sizes, padding rows writing a spare block).

Every member replays the same size each step, the smallest that holds the group's largest step; a member
without rows replays it with padding rows only; a step that some member cannot replay (a prompt chunk of
more rows than the largest graph) runs eagerly on every member. The arrivals: one replica works while the
other is idle for many steps, a request joins the idle one mid-wave (its prompt as a graph's rows beside the
other's decode row: padded to 8), a prompt too long for the graphs, and after the wave ends the other replica
alone. Greedy tokens and logprobs equal one engine with EP off; both members' replays agree size for size.
``tests/gpu/test_expert_parallel_gpu.py`` replays real graphs (NCCL) on two GPUs.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from ep_graph_targets import Arrival, Ran, Script, ep_graph_replica
from procs import rank_children

from engine import LLM, SamplingParams
from engine.parallel.rank_group import RankGroup

# Graphs of 1, 2, 4, 8 and 16 rows (max_num_seqs 4, max_cudagraph_capture_size 16); a 64-token budget.
ENGINE = dict(dtype="float32", device="cpu", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
              max_cudagraph_capture_size=16, num_kv_blocks=64)
LONG_PROMPT = [(i * 7 + 3) % 1000 + 2 for i in range(40)]  # 40 rows: more than the largest graph, eager
SHORT = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
LONG = SamplingParams(max_tokens=30, temperature=0.0, logprobs=1, ignore_eos=True)
ARRIVALS = [
    Arrival(0, 0, "a", LONG_PROMPT, LONG),  # replica 1 idle (padding rows only) until b, and after b and d
    Arrival(6, 1, "b", [5, 9, 17, 33, 65], SHORT),  # joins mid-wave: 5 prompt rows beside a's decode row
    Arrival(9, 0, "c", [4, 8, 15], SHORT),  # a's decode row beside c's prompt rows on replica 0
    Arrival(12, 1, "d", [(i * 11 + 5) % 1000 + 2 for i in range(20)], SHORT),  # 20 rows: eager on both
    Arrival(60, 1, "e", [3, 1, 4, 1, 5, 9, 2, 6], SHORT),  # a new wave: replica 0 idle throughout
    Arrival(60, 1, "f", [2, 7, 1, 8], LONG),
]


@pytest.fixture(scope="module")
def want(tiny_model: Path) -> dict[str, tuple[list[int], list[float]]]:
    """One engine, EP off, each request alone."""
    with LLM(str(tiny_model), **{k: v for k, v in ENGINE.items() if k != "max_cudagraph_capture_size"}) as llm:
        return {a.rid: (o.token_ids, o.logprobs) for a in ARRIVALS for o in llm.generate([a.prompt], a.params)}


def run(model: Path, fail_at: dict[int, int] | None = None, **engine: object) -> list[Ran]:
    script = Script(str(model), {**ENGINE, **engine}, ARRIVALS, fail_at or {})
    with RankGroup(ep_graph_replica, 2, [script, script], collective_timeout_s=60) as group:
        ran = [group.recv(r, 300) for r in range(2)]
    assert not rank_children()
    return ran


def same(ran: list[Ran], want: dict[str, tuple[list[int], list[float]]]) -> None:
    got = {**ran[0].outputs, **ran[1].outputs}
    assert sorted(got) == sorted(want)
    for rid, (ids, lps) in got.items():
        assert ids == want[rid][0], rid
        # The same products summed in another order (per choice, then over the group): fp32 rounding.
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(lps, want[rid][1])), rid
    assert [r.used_blocks for r in ran] == [0, 0]


@pytest.mark.parametrize("overlap", [False, True], ids=["steps", "overlapped"])
def test_ep_graph_steps_pad_to_one_size_and_equal_ep_off(tiny_model: Path, want, overlap: bool) -> None:
    ran = run(tiny_model, async_scheduling=overlap)
    same(ran, want)
    r0, r1 = ran
    assert r0.captured == r1.captured == [1, 2, 4, 8, 16]
    # Lockstep: the same steps, and every replay of the same size on both members, in the same order.
    assert r0.steps == r1.steps
    assert r0.launched == r1.launched and len(r0.launched) == r0.replays == r1.replays
    # Most steps replayed; the rest (prompts of more rows than the largest graph) ran eagerly on both.
    assert r0.steps - 5 <= r0.replays < r0.steps
    # Each idle for many steps: replica 1 while a decodes alone, replica 0 for all of e's and f's steps.
    assert r0.pad_replays >= 25 and r1.pad_replays >= 12
    # b's prompt (5 rows) as graph rows while replica 0 decoded one row: both replayed 8, padded.
    assert 8 in r0.launched and r1.prefill_replays >= 1 and r0.prefill_replays >= 1
    if overlap:
        assert r0.overlapped_steps > 0 and r1.overlapped_steps > 0


def test_a_size_one_member_cannot_capture_is_dropped_by_every_member(tiny_model: Path, want) -> None:
    """Replica 1 fails to capture the graph of 4 rows: neither keeps any graph, and every step runs eagerly
    (a member without rows: the MoE layers' collectives only), with the same tokens."""
    ran = run(tiny_model, fail_at={1: 4})
    same(ran, want)
    assert [r.captured for r in ran] == [[], []] and [r.replays for r in ran] == [0, 0]
    assert ran[0].steps == ran[1].steps > 40
