"""Local prefill on decode nodes, through a whole local cluster (redis, one prefill node, one decode node,
the proxy with ``local_prefill_max_tokens: 32``): short prompts are prefilled on the decode node, long
ones on the prefill node, and with the prefill node drained every prompt is (a colocated cluster).
Every path gives the colocated engine's greedy tokens and frees every block."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_cluster import ADMIN_KEY, Cluster, running_cluster, wait_all_free
from test_cluster import MODEL, client, colocated, pdctl, routed

from pdctl.topology import Topology

SHORT = [5, 9, 17, 33, 65, 129, 257, 11, 3, 7]  # 10 tokens: prefilled on the decode node
LONG = [(i * 7 + 3) % 1000 + 2 for i in range(200)]  # 200 tokens: on the prefill node


@pytest.fixture(scope="module")
def local_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
                  cluster_run_dirs: list[Path]) -> Iterator[Cluster]:
    run_dir = tmp_path_factory.mktemp("local")
    topo = Topology.from_dict({
        "model": str(tiny_model), "served_model_name": MODEL, "registry": {"cluster": f"local-{run_dir.name}"},
        "proxy": {"port": 0, "admin_key": ADMIN_KEY, "local_prefill_max_tokens": 32},
        "prefill": [{"max_model_len": 1024, "num_kv_blocks": 128, "lease_s": 10}],
        # local prefills, on a replica process with overlapped decode steps (what GPU nodes run by default)
        "decode": [{"max_model_len": 1024, "num_kv_blocks": 256, "enable_prefix_caching": True,
                    "dp_processes": "on", "async_scheduling": True}],
    })
    with running_cluster(topo, run_dir, tiny_model, cluster_run_dirs) as c:
        yield c


def test_short_prompts_prefill_on_the_decode_node_long_ones_on_the_prefill_node(local_cluster: Cluster) -> None:
    c = local_cluster
    want = colocated(c, [SHORT, LONG], [12, 10])
    before = routed(c)
    oa = client(c)
    short = oa.completions.create(model=MODEL, prompt=SHORT, max_tokens=12, temperature=0, logprobs=1)
    assert short.choices[0].text == want[0][1] and short.usage.completion_tokens == 12
    assert short.choices[0].logprobs.token_logprobs == pytest.approx(want[0][2], abs=1e-4)
    stream = oa.completions.create(model=MODEL, prompt=SHORT, max_tokens=12, temperature=0, stream=True,
                                   stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want[0][1]
    assert chunks[-1].usage.completion_tokens == 12
    long = oa.completions.create(model=MODEL, prompt=LONG, max_tokens=10, temperature=0)
    assert long.choices[0].text == want[1][1]
    after = routed(c)
    assert after.get(("prefill", "local"), 0) - before.get(("prefill", "local"), 0) == 2
    assert after.get(("prefill", "prefill-0"), 0) - before.get(("prefill", "prefill-0"), 0) == 1
    assert not any(wait_all_free(c).values())
    plan = c.admin.get("/admin/route", params={"prompt_tokens": 10}).json()
    assert plan["local_prefill"] and plan["prefill"] is None and "local prefill" in plan["decode"]["reason"]
    assert "prefill: local" in pdctl(c, "route", "--prompt-tokens", "10")


def test_with_the_prefill_node_drained_every_prompt_is_prefilled_locally(local_cluster: Cluster) -> None:
    c = local_cluster
    want = colocated(c, [LONG], [8])
    assert c.admin.post("/admin/nodes/prefill-0/drain").json()["draining"]
    try:
        health = httpx.get(f"{c.url}/health", timeout=10)  # decode nodes that prefill serve alone
        assert health.status_code == 200 and health.json()["local_prefill"] and health.json()["prefill"] == 0
        before = routed(c)
        out = client(c).completions.create(model=MODEL, prompt=LONG, max_tokens=8, temperature=0)
        assert out.choices[0].text == want[0][1]
        after = routed(c)
        assert after.get(("prefill", "local"), 0) - before.get(("prefill", "local"), 0) == 1
        assert after.get(("prefill", "prefill-0"), 0) == before.get(("prefill", "prefill-0"), 0)
    finally:
        c.admin.post("/admin/nodes/prefill-0/undrain")
    assert not any(wait_all_free(c).values())


def test_a_client_that_leaves_a_local_stream_frees_the_decode_blocks(local_cluster: Cluster) -> None:
    c = local_cluster
    body = {"model": MODEL, "prompt": SHORT, "max_tokens": 500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    seen = 0
    with httpx.stream("POST", f"{c.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                assert "error" not in json.loads(line[6:])
                seen += 1
                if seen == 3:
                    break
    used = wait_all_free(c)
    assert not any(used.values()), f"blocks still used after the client left: {used}"
