"""Speculative decoding with DeepSeek-V3's multi-token prediction layer through a whole local cluster: a model
with an MTP layer (``pdctl make-model --arch v3 --mtp-layers 1``), a prefill node and a DP2 decode node (its
replicas as processes) both with ``speculative_config``, a second decode node without it, and a second
prefill node with it on PCP2 rank processes (sharded KV; drained but in its own test). With the openai
client, greedy answers equal one engine's without speculative decoding; the prefill node's draft and the MTP
layer's KV of the prompt travel with the request (from each PCP rank its shard of it), so the decode node
verifies drafts from its very first step (its /metrics count a verify step for every step of every request);
the node without it takes the stack's layers only and answers the same."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from e2e_cluster import ADMIN_KEY, Cluster, running_cluster, scrape, wait_all_free
from test_cluster import KW, MODEL, client, metric, pdctl

from engine import LLM, SamplingParams
from pdctl.tiny_model import make_tiny_model
from pdctl.topology import Topology

SPEC = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
PROMPTS = [[(i * k + 5) % 1000 + 2 for i in range(n)] for k, n in ((3, 40), (7, 130), (11, 9))]
TOKENS = 18


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mtp-model") / MODEL, arch="v3", seed=11, mtp_layers=1)


@pytest.fixture(scope="module")
def mtp_cluster(mtp_model: Path, tmp_path_factory: pytest.TempPathFactory,
                cluster_run_dirs: list[Path]) -> Iterator[Cluster]:
    run_dir = tmp_path_factory.mktemp("mtp")
    topo = Topology.from_dict({
        "model": str(mtp_model), "served_model_name": MODEL, "registry": {"cluster": f"mtp-{run_dir.name}"},
        "proxy": {"port": 0, "admin_key": ADMIN_KEY},
        "prefill": [{"max_model_len": 1024, "num_kv_blocks": 128, "speculative_config": SPEC},
                    {"pcp": 2, "max_model_len": 1024, "num_kv_blocks": 128, "speculative_config": SPEC}],
        "decode": [{"dp": 2, "dp_processes": "on", "max_model_len": 1024, "num_kv_blocks": 128,
                    "speculative_config": json.loads(SPEC)},  # a topology's mapping form
                   {"max_model_len": 1024, "num_kv_blocks": 128}],
    })
    with running_cluster(topo, run_dir, mtp_model, cluster_run_dirs) as c:
        _only(c, "prefill-0", ("prefill-0", "prefill-1"))  # prefill-1 (PCP2) serves in its own test
        yield c


def _spec_counts(c: Cluster, node: str) -> dict[str, float]:
    page = scrape(f"http://{c.nodes()[node]['metrics_address']}/metrics")
    return {name: page.total(f"vllm:spec_decode_num_{name}_total") for name in ("drafts", "draft_tokens",
                                                                                 "accepted_tokens")}


def _prompt_tokens(c: Cluster, node: str) -> float:
    return scrape(f"http://{c.nodes()[node]['metrics_address']}/metrics").total("vllm:prompt_tokens_total")


def _answers(c: Cluster) -> list[str]:
    oa = client(c)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: oa.completions.create(model=MODEL, prompt=p, max_tokens=TOKENS, temperature=0,
                                                            extra_body={"ignore_eos": True}), PROMPTS))
    assert all(g.usage.completion_tokens == TOKENS for g in got)
    return [g.choices[0].text for g in got]


def _only(c: Cluster, node: str, among: tuple[str, ...]) -> None:
    for other in among:
        verb = "undrain" if other == node else "drain"
        httpx.post(f"{c.url}/admin/nodes/{other}/{verb}", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                   timeout=10).raise_for_status()


def _only_decode(c: Cluster, node: str) -> None:
    _only(c, node, ("decode-0", "decode-1"))


@pytest.fixture(scope="module")
def want(mtp_model: Path) -> list[str]:
    with LLM(str(mtp_model), **KW) as llm:
        return [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0.0,
                                                                     ignore_eos=True))]


def test_the_decode_node_verifies_drafts_from_its_first_step_and_answers_as_one_engine(
        mtp_cluster: Cluster, want: list[str]) -> None:
    _only_decode(mtp_cluster, "decode-0")
    before = _spec_counts(mtp_cluster, "decode-0")
    assert _answers(mtp_cluster) == want
    moved = {k: v - before[k] for k, v in _spec_counts(mtp_cluster, "decode-0").items()}
    # Every decode step of every request verified drafts, the first one the prefill node's: at most
    # TOKENS - 1 steps each, at least (TOKENS - 1) / 3 (two drafts and the bonus per step).
    assert len(PROMPTS) * (TOKENS - 1) / 3 <= moved["drafts"] <= len(PROMPTS) * (TOKENS - 1)
    assert moved["draft_tokens"] >= moved["drafts"]
    assert moved["accepted_tokens"] <= moved["draft_tokens"]
    deadline = time.monotonic() + 10  # decode-0's counts reach the registry with its next heartbeat
    while "% accepted" not in (status := pdctl(mtp_cluster, "status")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "% accepted" in status and "MTP on" in status  # decode-0's acceptance; the prefill node's line
    route = pdctl(mtp_cluster, "route", "--prompt-tokens", "40")
    assert "speculative decoding: MTP, 2 tokens drafted a step, from the first decode step: prefill-0's" in route
    assert not any(wait_all_free(mtp_cluster).values())


def test_a_decode_node_without_it_takes_the_stacks_layers_and_answers_the_same(mtp_cluster: Cluster,
                                                                               want: list[str]) -> None:
    _only_decode(mtp_cluster, "decode-1")
    route = pdctl(mtp_cluster, "route", "--prompt-tokens", "40")
    assert "speculative decoding: prefill-0 drafts with its MTP layer, decode-1 does not run it" in route
    assert _answers(mtp_cluster) == want
    assert _spec_counts(mtp_cluster, "decode-1") == {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    _only_decode(mtp_cluster, "decode-0")
    assert not any(wait_all_free(mtp_cluster).values())


def test_a_pcp2_prefill_node_hands_off_its_sharded_mtp_kv_and_draft(mtp_cluster: Cluster, want: list[str]) -> None:
    """prefill-1 runs PCP2 rank processes: the MTP layer on each rank over its rows, its KV sharded as the
    stack's; decode-0 pulls every shard and drafts from the first step, as from prefill-0. (A handle without
    the MTP layer's KV would be pulled not at all: decode-0 would compute the prompt again, mtp_recompute.)"""
    _only(mtp_cluster, "prefill-1", ("prefill-0", "prefill-1"))
    _only_decode(mtp_cluster, "decode-0")
    try:
        route = pdctl(mtp_cluster, "route", "--prompt-tokens", "40")
        assert "speculative decoding: MTP, 2 tokens drafted a step, from the first decode step: prefill-1's" in route
        before, prompted = _spec_counts(mtp_cluster, "decode-0"), _prompt_tokens(mtp_cluster, "prefill-1")
        pulled = metric(mtp_cluster, "pdcluster_proxy_kv_transfer_bytes_total")
        assert _answers(mtp_cluster) == want
        assert _prompt_tokens(mtp_cluster, "prefill-1") - prompted == sum(map(len, PROMPTS))  # prefilled there
        assert metric(mtp_cluster, "pdcluster_proxy_kv_transfer_bytes_total") > pulled  # pulled, not recomputed
        moved = {k: v - before[k] for k, v in _spec_counts(mtp_cluster, "decode-0").items()}
        assert len(PROMPTS) * (TOKENS - 1) / 3 <= moved["drafts"] <= len(PROMPTS) * (TOKENS - 1)
        assert moved["accepted_tokens"] <= moved["draft_tokens"]
    finally:
        _only(mtp_cluster, "prefill-0", ("prefill-0", "prefill-1"))
    assert not any(wait_all_free(mtp_cluster).values())
