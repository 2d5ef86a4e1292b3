"""Routing rules of the proxy: PCP-aware prefill cost, decode by load, never a draining/unhealthy node."""

from __future__ import annotations

import time

import pytest

from cluster.nodes import NodeInfo, NodeState, ReplicaLoad
from proxy.routing.router import (
    LONG_PROMPT_TOKENS,
    NoRoute,
    Router,
    effective_pcp,
    prefill_cost,
)

MODEL = "m"


def node(node_id: str, role: str = "prefill", *, pcp: int = 1, dp: int = 1, queued: int | list[int] = 0,
         running: int | list[int] = 0, free: int | None = 1000, draining: bool = False, healthy: bool = True,
         model: str = MODEL, max_model_len: int = 100_000, num_blocks: int = 1000,
         engine: str = "native", kv_protocol: str = "tcp", local_prefill: bool = False,
         kv_cache_dtype: str = "") -> NodeState:
    info = NodeInfo(node_id=node_id, role=role, address=f"{node_id}:1", model=model, max_model_len=max_model_len,
                    dp=dp, pcp=pcp, pp=1, kv_layout="sharded", block_size=16, num_blocks=num_blocks,
                    started_at=time.time(), engine=engine, kv_protocol=kv_protocol, local_prefill=local_prefill,
                    kv_cache_dtype=kv_cache_dtype)
    q = queued if isinstance(queued, list) else [queued] * dp
    r = running if isinstance(running, list) else [running] * dp
    replicas = () if free is None else tuple(
        ReplicaLoad(dp_rank=i, queued_prefill_tokens=q[i], running=r[i], free_blocks=free) for i in range(dp))
    return NodeState(info=info, replicas=replicas, draining=draining, healthy=healthy, heartbeat_at=time.time())


DECODE = node("d", "decode", num_blocks=10_000, free=10_000)


def test_effective_pcp_ramps_with_prompt_length() -> None:
    assert effective_pcp(1, 10) == 1
    assert effective_pcp(4, 0) == 1
    assert effective_pcp(4, LONG_PROMPT_TOKENS // 2) == pytest.approx(2.5)
    assert effective_pcp(4, LONG_PROMPT_TOKENS) == 4
    assert effective_pcp(4, 10 * LONG_PROMPT_TOKENS) == 4
    assert prefill_cost(0, 8192, 4) < prefill_cost(0, 8192, 1)


def test_long_prompt_goes_to_the_biggest_pcp_group() -> None:
    nodes = [node("small", pcp=1), node("big", pcp=4), DECODE]
    route = Router(MODEL).route(nodes, prompt_tokens=16_000, max_tokens=16)
    assert route.prefill.node_id == "big"
    # ... even when the big group already has some work queued
    nodes = [node("small", pcp=1), node("big", pcp=4, queued=20_000), DECODE]
    assert Router(MODEL).route(nodes, 16_000, 16).prefill.node_id == "big"


def test_short_prompt_goes_to_the_least_loaded() -> None:
    nodes = [node("a", pcp=1, queued=300), node("b", pcp=1, queued=20), node("big", pcp=4, queued=200), DECODE]
    assert Router(MODEL).route(nodes, prompt_tokens=50, max_tokens=16).prefill.node_id == "b"
    # idle cluster: a short prompt leaves the big PCP group to long ones
    nodes = [node("a", pcp=1), node("big", pcp=4), DECODE]
    assert Router(MODEL).route(nodes, prompt_tokens=50, max_tokens=16).prefill.node_id == "a"


def test_dp_replicas_are_separate_candidates() -> None:
    nodes = [node("p", dp=2, pcp=2, queued=[900, 10]), DECODE]
    route = Router(MODEL).route(nodes, 100, 16)
    assert (route.prefill.node_id, route.prefill.dp_rank) == ("p", 1)


@pytest.mark.parametrize("bad", [
    {"draining": True}, {"healthy": False}, {"model": "other"}, {"max_model_len": 100},
])
def test_ineligible_prefill_nodes_are_never_chosen(bad: dict[str, object]) -> None:
    # The ineligible node is idle and has the biggest PCP group: it would win if it were eligible.
    nodes = [node("bad", pcp=8, **bad), node("ok", pcp=1, queued=5000), DECODE]
    router = Router(MODEL)
    for _ in range(5):
        assert router.route(nodes, 4000, 16).prefill.node_id == "ok"
    plan = router.plan(nodes, 4000, 16)
    bad_c = next(c for c in plan.prefill_candidates if c.node_id == "bad")
    assert not bad_c.eligible and bad_c.reason
    assert bad_c.to_dict()["cost"] is None


def test_ineligible_decode_nodes_are_never_chosen() -> None:
    nodes = [node("p"), node("d-drain", "decode", draining=True), node("d-dead", "decode", healthy=False),
             node("d-busy", "decode", running=50)]
    router = Router(MODEL)
    assert all(router.route(nodes, 100, 16).decode.node_id == "d-busy" for _ in range(4))
    reasons = {c.node_id: c.reason for c in router.plan(nodes, 100, 16).decode_candidates}
    assert reasons["d-drain"] == "draining" and "unhealthy" in reasons["d-dead"]


def test_no_route_codes() -> None:
    with pytest.raises(NoRoute) as e:
        Router(MODEL).route([DECODE], 10, 10)
    assert e.value.code == "no_prefill_node" and "no prefill node" in e.value.message
    with pytest.raises(NoRoute) as e:
        Router(MODEL).route([node("p", draining=True), DECODE], 10, 10)
    assert e.value.code == "no_prefill_node" and "draining" in e.value.message
    with pytest.raises(NoRoute) as e:
        Router(MODEL).route([node("p"), node("d", "decode", healthy=False)], 10, 10)
    assert e.value.code == "no_decode_node"


def test_decode_by_load_and_free_blocks() -> None:
    nodes = [node("p"), node("d1", "decode", running=5), node("d2", "decode", running=2, dp=2),
             node("d3", "decode", running=1, free=3)]
    router = Router(MODEL)
    # d3 is the least busy but 3 free blocks of 16 tokens cannot hold 100 + 16 tokens
    route = router.route(nodes, 100, 16)
    assert route.decode.node_id == "d2"
    d3 = next(c for c in router.plan(nodes, 100, 16).decode_candidates if c.node_id == "d3")
    assert not d3.eligible and d3.reason == "needs 8 KV blocks, 3 free"
    # a short request fits on d3
    assert router.route(nodes, 10, 10).decode.node_id == "d3"
    # a request longer than a node's whole cache never goes there
    small = [node("p"), node("tiny", "decode", num_blocks=4, free=None)]
    with pytest.raises(NoRoute):
        router.route(small, 100, 16)


def test_decode_ties_broken_by_free_blocks_then_turns() -> None:
    nodes = [node("p"), node("d1", "decode", free=500), node("d2", "decode", free=900)]
    assert Router(MODEL).route(nodes, 10, 10).decode.node_id == "d2"
    nodes = [node("p"), node("d1", "decode"), node("d2", "decode")]
    router = Router(MODEL)
    picks = [router.route(nodes, 10, 10).decode.node_id for _ in range(4)]
    assert picks == ["d1", "d2", "d1", "d2"]


def test_equal_prefill_replicas_take_turns_deterministically() -> None:
    nodes = [node("p2"), node("p1"), DECODE]
    picks = [Router(MODEL).route(nodes, 100, 10).prefill.node_id for _ in range(3)]
    assert picks == ["p1", "p1", "p1"]  # a fresh router always starts at the same one
    router = Router(MODEL)
    assert [router.route(nodes, 100, 10).prefill.node_id for _ in range(4)] == ["p1", "p2", "p1", "p2"]


def test_local_in_flight_load_counts_before_heartbeats() -> None:
    nodes = [node("a"), node("b"), node("d1", "decode"), node("d2", "decode")]
    router = Router(MODEL)
    first = router.route(nodes, 1000, 10)
    router.load.add(first.prefill.node_id, first.prefill.dp_rank, tokens=1000)
    router.load.add(first.decode.node_id, first.decode.dp_rank, seqs=1)
    plan = router.plan(nodes, 1000, 10)
    assert plan.prefill.node_id != first.prefill.node_id
    assert plan.decode.node_id != first.decode.node_id
    queued = {c.node_id: c.queued_tokens for c in plan.prefill_candidates}
    assert queued[first.prefill.node_id] == 1000


def test_plan_explains_without_side_effects() -> None:
    nodes = [node("a"), node("b"), node("big", pcp=2, draining=True), DECODE]
    router = Router(MODEL)
    plans = [router.plan(nodes, 1200, 10) for _ in range(3)]
    assert len({p.prefill.node_id for p in plans}) == 1  # plan() does not take a turn
    p = plans[0].prefill
    assert p.reason.startswith("lowest estimated cost 1200 (queued 0 + 1200 tokens over effective PCP 1.00")
    assert plans[0].decode.reason.startswith("least loaded: 0 running")
    assert {c.node_id: c.eligible for c in plans[0].prefill_candidates} == {"a": True, "b": True, "big": False}
    d = p.to_dict()
    assert {"node_id", "dp_rank", "pcp", "cost", "reason", "eligible"} <= set(d)


def test_pcp_reason_mentions_effective_speedup() -> None:
    nodes = [node("big", pcp=2), DECODE]
    p = Router(MODEL).plan(nodes, 1024, 10).prefill
    assert "effective PCP 1.50" in p.reason and "PCP overhead 16" in p.reason
    assert p.cost == pytest.approx(1024 / 1.5 + 16)


def test_local_prefill_for_short_prompts_and_as_the_fallback() -> None:
    """Conditional disaggregation: prompts up to the threshold are prefilled on a decode rank that can
    (native decode nodes say so), others go to a prefill replica; with no prefill replica that can take a
    request, a capable decode rank prefills it unless the fallback is off."""
    pre = node("p")
    dec = node("d", "decode", num_blocks=10_000, free=10_000, running=3, local_prefill=True)
    other = node("e", "decode", num_blocks=10_000, free=10_000)  # idler, but cannot prefill
    router = Router(MODEL, local_prefill_max_tokens=64)
    short = router.route([pre, dec, other], 64, 16)
    assert short.prefill is None and short.decode.node_id == "d"
    assert short.decode.reason == ""  # route() decides only: its reasons come from plan()
    assert router.plan([pre, dec, other], 64, 16).decode.reason.startswith("local prefill: a prompt of 64 <= 64")
    long = router.route([pre, dec, other], 65, 16)
    assert long.prefill is not None and long.decode.node_id == "e"  # disaggregated: the least loaded rank
    # No prefill node (a colocated cluster, or all drained): local prefill on the capable rank.
    fallback = Router(MODEL).route([node("p", draining=True), dec, other], 5000, 16)
    assert fallback.prefill is None and fallback.decode.node_id == "d"
    assert "no prefill replica can take it" in Router(MODEL).plan([node("p", draining=True), dec, other], 5000,
                                                                  16).decode.reason
    # A prefill node whose KV no decode rank can read (another protocol): prefilled locally as well.
    nv_dec = node("g", "decode", num_blocks=10_000, free=10_000, kv_protocol="nvlink_intra", local_prefill=True)
    assert Router(MODEL).route([pre, nv_dec], 5000, 16).prefill is None
    with pytest.raises(NoRoute) as e:
        Router(MODEL, local_prefill_fallback=False).route([dec], 100, 16)
    assert e.value.code == "no_prefill_node"
    with pytest.raises(NoRoute):  # no decode node can prefill: the request cannot be served
        Router(MODEL).route([other], 100, 16)
    # A decode leg moved after a local prefill failed stays local (another capable rank).
    dec2 = node("f", "decode", num_blocks=10_000, free=10_000, running=9, local_prefill=True)
    plan = Router(MODEL).plan([pre, dec, dec2, other], 5000, 16, exclude_decode=[("d", 0)], local=True)
    assert plan.local and plan.prefill is None and plan.decode.node_id == "f"


def test_kv_protocols_pair_only_with_the_same_protocol() -> None:
    """A prefill node on NVLink hands its KV only to decode nodes on NVLink (Mooncake needs both ends on
    one protocol); with none, it is not eligible and says why."""
    nv_pre = node("a-nv", kv_protocol="nvlink_intra")
    tcp_pre = node("b-tcp")
    nv_dec = node("d-nv", "decode", num_blocks=10_000, free=10_000, running=5, kv_protocol="nvlink_intra")
    tcp_dec = node("e-tcp", "decode", num_blocks=10_000, free=10_000)
    route = Router(MODEL).route([nv_pre, nv_dec, tcp_dec], 100, 16)
    assert (route.prefill.node_id, route.decode.node_id) == ("a-nv", "d-nv")  # not the idler tcp node
    plan = Router(MODEL).plan([nv_pre, tcp_pre, tcp_dec], 100, 16)
    assert plan.prefill.node_id == "b-tcp"
    assert "can read a native (nvlink_intra) node's KV" in plan.prefill_candidates[0].reason
    dec = {c.node_id: c for c in Router(MODEL).plan([nv_pre, nv_dec, tcp_dec], 100, 16).decode_candidates}
    assert not dec["e-tcp"].eligible and "native (tcp) decode node cannot read" in dec["e-tcp"].reason


def test_kv_formats_pair_only_with_the_same_format() -> None:
    """A prefill node with an FP8 cache hands its KV only to decode nodes holding FP8 rows of the same
    layout; with none, it is not eligible and says why (as pdctl route shows)."""
    fp8_pre = node("a-fp8", kv_cache_dtype="fp8")
    bf16_pre = node("b-bf16", kv_cache_dtype="bfloat16")
    ds_dec = node("c-ds", "decode", num_blocks=10_000, free=10_000, kv_cache_dtype="fp8_ds_mla")
    fp8_dec = node("d-fp8", "decode", num_blocks=10_000, free=10_000, running=5, kv_cache_dtype="fp8")
    bf16_dec = node("e-bf16", "decode", num_blocks=10_000, free=10_000, kv_cache_dtype="bfloat16")
    route = Router(MODEL).route([fp8_pre, ds_dec, fp8_dec, bf16_dec], 100, 16)
    assert (route.prefill.node_id, route.decode.node_id) == ("a-fp8", "d-fp8")  # not the idler others
    plan = Router(MODEL).plan([fp8_pre, bf16_pre, bf16_dec], 100, 16)
    assert plan.prefill.node_id == "b-bf16"
    assert "can read a native (tcp, fp8 KV) node's KV" in plan.prefill_candidates[0].reason
    dec = {c.node_id: c for c in Router(MODEL).plan([fp8_pre, ds_dec, fp8_dec], 100, 16).decode_candidates}
    assert dec["d-fp8"].eligible
    assert not dec["c-ds"].eligible and "native (tcp, fp8_ds_mla KV) decode node cannot read" in dec["c-ds"].reason
    with pytest.raises(NoRoute) as e:
        Router(MODEL).route([fp8_pre, bf16_dec], 100, 16)
    assert e.value.code == "no_prefill_node" and "fp8 KV" in e.value.message
    # Records of nodes that publish no format (older versions) pair as before.
    assert Router(MODEL).route([node("p"), fp8_dec], 100, 16).decode.node_id == "d-fp8"


def test_engines_pair_only_where_the_decode_side_can_read_the_kv() -> None:
    """A vLLM prefill node's KV goes only to vLLM decode nodes; a native node's handle to either."""
    vllm_pre = node("a-vllm", engine="vllm")  # sorts first: the tie would pick it
    native_pre = node("b-native")
    native_dec = node("d-native", "decode", num_blocks=10_000, free=10_000)
    vllm_dec = node("e-vllm", "decode", num_blocks=10_000, free=10_000, running=5, engine="vllm")
    # Only native decode: the vLLM prefill node is not eligible, and says why.
    plan = Router(MODEL).plan([vllm_pre, native_pre, native_dec], 100, 16)
    assert plan.prefill.node_id == "b-native" and plan.decode.node_id == "d-native"
    assert "can read a vllm (tcp) node's KV" in plan.prefill_candidates[0].reason
    # Both decode engines: the vLLM prefill node is chosen, so only the (busier) vLLM decode node fits.
    route = Router(MODEL).route([vllm_pre, native_pre, native_dec, vllm_dec], 100, 16)
    assert (route.prefill.node_id, route.decode.node_id) == ("a-vllm", "e-vllm")
    # Native prefill: the least loaded decode node of either engine.
    route = Router(MODEL).route([native_pre, native_dec, vllm_dec], 100, 16)
    assert route.decode.node_id == "d-native"
    route = Router(MODEL).route([native_pre, vllm_dec], 100, 16)
    assert route.decode.node_id == "e-vllm"
    # A decode leg moved after a vLLM prefill stays on vLLM decode nodes.
    plan = Router(MODEL).plan([vllm_pre, native_pre, native_dec, vllm_dec], 100, 16, prefill_node="a-vllm")
    assert plan.decode.node_id == "e-vllm"
    with pytest.raises(NoRoute) as e:
        Router(MODEL).route([vllm_pre, native_dec], 100, 16)
    assert e.value.code == "no_prefill_node" and "can read a vllm (tcp) node's KV" in e.value.message
    # A decode leg moved after a prefill node left the view: only decode nodes that read any KV.
    plan = Router(MODEL).plan([native_pre, native_dec, vllm_dec], 100, 16, prefill_node="gone")
    assert plan.decode.node_id == "e-vllm"
    # Records published before the engine field existed read as native nodes.
    d = native_pre.info.to_dict()
    del d["engine"]
    assert NodeInfo.from_dict(d).engine == "native"


def test_excluded_decode_ranks_are_never_chosen() -> None:
    # d0 rank 0 is the least loaded, then d0 rank 1, then d1: excluding a rank leaves the node's others.
    nodes = [node("p"), node("d0", "decode", dp=2, running=[0, 1]), node("d1", "decode", running=2)]
    router = Router(MODEL)
    first = router.plan(nodes, 10, 10).decode
    assert (first.node_id, first.dp_rank) == ("d0", 0)
    other = router.plan(nodes, 10, 10, exclude_decode=[("d0", 0)]).decode
    assert (other.node_id, other.dp_rank) == ("d0", 1)
    last = router.plan(nodes, 10, 10, exclude_decode=[("d0", 0), ("d0", 1)])
    assert last.decode.node_id == "d1"
    why = {(c.node_id, c.dp_rank): c for c in last.decode_candidates}
    assert not why[("d0", 0)].eligible and "refused" in why[("d0", 0)].reason
    assert router.plan(nodes, 10, 10, exclude_decode=[("d0", 0), ("d0", 1), ("d1", 0)]).decode is None


def test_a_prefill_replica_with_the_prompts_prefix_cached_costs_only_the_rest() -> None:
    from proxy.routing.prefix_index import PrefixIndex

    nodes = [node("p0"), node("p1"), DECODE]
    router = Router(MODEL)
    cached = {("p1", 0): 1000}
    plan = router.plan(nodes, 1200, 8, cached=lambda node, dp: cached.get((node, dp), 0))
    assert plan.prefill is not None and plan.prefill.node_id == "p1" and plan.prefill.cached_tokens == 1000
    assert "1000 of the prompt's tokens expected in its prefix cache" in plan.prefill.reason
    # the index behind it: leading blocks only, bounded by the replica's blocks (LRU)
    index = PrefixIndex()
    hashes = PrefixIndex.hashes(list(range(100)), 16)  # (100 - 1) // 16 = 6 blocks can hit
    assert len(hashes) == 6
    index.record("p1", 0, hashes[:4], capacity=10)
    assert index.expected_hit("p1", 0, hashes) == 4 and index.expected_hit("p0", 0, hashes) == 0
    index.record("p1", 0, PrefixIndex.hashes(list(range(500, 700)), 16), capacity=10)  # 12 newer blocks
    assert index.expected_hit("p1", 0, hashes) == 0  # the old ones were the least recent
    index.forget({"p0"})
    assert index.expected_hit("p1", 0, PrefixIndex.hashes(list(range(500, 700)), 16)) == 0


def test_a_decode_rank_holding_the_prompts_prefix_wins_unless_much_busier() -> None:
    nodes = [node("p0"), node("d0", "decode", dp=2, running=[3, 0], num_blocks=10_000, free=10_000)]
    router = Router(MODEL)
    cached = {("d0", 0): 640}
    hit = lambda node_id, dp: cached.get((node_id, dp), 0)  # noqa: E731
    plan = router.plan(nodes, 700, 8, cached=hit)
    assert (plan.decode.node_id, plan.decode.dp_rank) == ("d0", 0) and plan.decode.cached_tokens == 640
    assert plan.decode.reason.startswith("most of the prompt cached") and "640 of the prompt's" in plan.decode.reason
    assert plan.prefill.node_id == "p0"
    # too busy: more than decode_hit_slack running sequences over the least loaded rank
    nodes = [node("p0"), node("d0", "decode", dp=2, running=[5, 0], num_blocks=10_000, free=10_000)]
    plan = router.plan(nodes, 700, 8, cached=hit)
    assert plan.decode.dp_rank == 1 and plan.decode.reason.startswith("least loaded")
    # a local prefill picks the same way
    nodes = [node("d0", "decode", dp=2, running=[2, 0], num_blocks=10_000, free=10_000, local_prefill=True)]
    plan = Router(MODEL, local_prefill_max_tokens=1000).plan(nodes, 700, 8, cached=hit)
    assert plan.local and plan.decode.dp_rank == 0 and "most of the prompt cached" in plan.decode.reason
