"""The proxy against fake nodes (``fake_cluster.py``): draining, the admin API and pdctl's client of
it, the API and admin keys, and the metrics page."""

from __future__ import annotations

import openai
import pytest
from fake_cluster import ADMIN_KEY, API_KEY, LONG_PROMPT, MAX_MODEL_LEN, MODEL, Cluster
from proxy_fakes import wait_until

# --- admin, drain, routing -----------------------------------------------------------------------


def test_drain_stops_routing_at_once(c: Cluster) -> None:
    with c.http(ADMIN_KEY) as admin:
        r = admin.post("/admin/nodes/p1/drain")
        assert r.status_code == 200 and r.json() == {"node_id": "p1", "draining": True}
        nodes = {n["node_id"]: n for n in admin.get("/admin/nodes").json()["nodes"]}
        assert nodes["p1"]["draining"] is True and nodes["p0"]["draining"] is False
        assert {"inflight", "replicas", "healthy", "pcp", "address"} <= set(nodes["p0"])
        client = c.client()
        for _ in range(4):
            client.completions.create(model=MODEL, prompt=LONG_PROMPT[:400], max_tokens=2)  # long: would pick PCP 2
        assert len(c.p0.requests) == 4 and c.p1.requests == []
        assert admin.post("/admin/nodes/p0/drain").status_code == 200
        r = c.http().post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_prefill_node"
        assert c.http(None).get("/health").status_code == 503
        r = admin.get("/admin/route", params={"prompt_tokens": 10})
        assert r.status_code == 503 and all(not x["eligible"] for x in r.json()["candidates"])
        assert admin.post("/admin/nodes/p1/undrain").json() == {"node_id": "p1", "draining": False}
        assert admin.post("/admin/nodes/nope/drain").status_code == 404
    client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert len(c.p1.requests) == 1


def test_admin_route_explains(c: Cluster) -> None:
    with c.http(ADMIN_KEY) as admin:
        long = admin.get("/admin/route", params={"prompt_tokens": 400}).json()
        short = admin.get("/admin/route", params={"prompt_tokens": 8}).json()
    assert long["prefill"]["node_id"] == "p1" and long["prefill"]["pcp"] == 2
    assert short["prefill"]["node_id"] == "p0"
    assert long["decode"]["node_id"] == "d0" and "running" in long["decode"]["reason"]
    assert {x["node_id"] for x in long["candidates"]} == {"p0", "p1"}
    assert "effective PCP" in long["prefill"]["reason"]


def test_admin_route_says_why_no_node_is_eligible(c: Cluster) -> None:
    with c.http(ADMIN_KEY) as admin:
        r = admin.get("/admin/route", params={"prompt_tokens": MAX_MODEL_LEN + 100})
    assert r.status_code == 503
    message = r.json()["error"]["message"]  # what pdctl route prints: every candidate's reason
    assert all(f"{x['node_id']} rank {x['dp_rank']}: {x['reason']}" in message for x in r.json()["candidates"])
    assert str(MAX_MODEL_LEN) in message, message


def test_pdctl_admin_client_understands_the_admin_api(c: Cluster) -> None:
    from pdctl.admin_client import AdminClient

    admin = AdminClient(c.url, ADMIN_KEY)
    try:
        nodes = {n.state.info.node_id: n for n in admin.nodes()}
        assert set(nodes) == {"p0", "p1", "d0"} and nodes["p1"].state.info.pcp == 2
        route = admin.route(400)
        assert route.prefill.node_id == "p1" and route.decode.node_id == "d0" and len(route.candidates) == 2
        assert admin.set_draining("p1", True) is True
        assert admin.route(400).prefill.node_id == "p0"
        assert admin.set_draining("p1", False) is False
    finally:
        admin.close()


def test_keys_are_enforced(c: Cluster) -> None:
    for key in (None, "wrong"):
        with c.http(key) as h:
            r = h.get("/v1/models")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert h.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{c.url}/v1", api_key="bad", max_retries=0).models.list()
    with c.http(API_KEY) as h:  # the API key is not the admin key
        assert h.get("/admin/nodes").status_code == 401
        assert h.post("/admin/nodes/p0/drain").status_code == 401
    assert not c.source.snapshot()[0].draining
    with c.http(None) as h:  # health and metrics are open
        assert h.get("/health").status_code == 200 and h.get("/metrics").status_code == 200


def test_metrics_series(c: Cluster) -> None:
    client = c.client()
    client.completions.create(model=MODEL, prompt="x", max_tokens=4)
    list(client.completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True))
    with c.http(None) as h:
        h.post("/v1/completions", json={})
        # the stream's cleanup may finish just after its last byte reached the client
        assert wait_until(lambda: "pdcluster_proxy_inflight_requests 0.0" in h.get("/metrics").text)
        text = h.get("/metrics").text
    for series in ("pdcluster_proxy_requests_total", "pdcluster_proxy_time_to_first_token_seconds_bucket",
                   "pdcluster_proxy_inter_token_latency_seconds_bucket", "pdcluster_proxy_kv_transfer_seconds_bucket",
                   "pdcluster_proxy_kv_transfer_bytes_total", "pdcluster_proxy_errors_total",
                   "pdcluster_proxy_inflight_requests", "pdcluster_proxy_routing_decisions_total"):
        assert series in text, series
    assert 'endpoint="/v1/completions",status="200"' in text
    assert 'endpoint="/v1/completions",status="401"' in text
    assert 'node_id="d0",role="decode"' in text
