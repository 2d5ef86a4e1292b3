"""`pdctl status / nodes / drain / undrain / route` against a fake proxy admin API (a local HTTP thread)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from typer.testing import CliRunner

from cluster.net import free_port
from pdctl import cli, launcher

ADMIN_KEY = "sesame"


def node(node_id: str, role: str, **extra: object) -> dict:
    d = {"node_id": node_id, "role": role, "address": f"127.0.0.1:{5000 + len(node_id)}", "model": "tiny",
         "max_model_len": 2048, "dp": 2 if role == "prefill" else 1, "pcp": 2 if role == "prefill" else 1, "pp": 1,
         "kv_layout": "sharded" if role == "prefill" else "replicated", "block_size": 16, "num_blocks": 64,
         "kv_cache_dtype": "fp8_ds_mla", "weights": "fp8 experts, bfloat16",
         "started_at": 1.0, "draining": False, "heartbeat_at": 2.0, "healthy": True,
         "inflight": 3,
         "replicas": [{"dp_rank": 0, "queued_prefill_tokens": 100, "waiting": 1, "running": 2, "used_blocks": 10,
                       "free_blocks": 54},
                      {"dp_rank": 1, "queued_prefill_tokens": 20, "waiting": 0, "running": 1, "used_blocks": 5,
                       "free_blocks": 59}]}
    d.update(extra)
    return d


ROUTE = {
    "prefill": {"node_id": "prefill-0", "dp_rank": 1, "pcp": 2, "cost": 120.5, "reason": "least queued tokens"},
    "decode": {"node_id": "decode-0", "dp_rank": 0, "reason": "most free KV blocks"},
    "candidates": [
        {"node_id": "prefill-0", "dp_rank": 0, "pcp": 2, "cost": 300.0, "eligible": True, "reason": "busier"},
        {"node_id": "prefill-0", "dp_rank": 1, "pcp": 2, "cost": 120.5, "eligible": True, "reason": "chosen"},
        {"node_id": "prefill-1", "dp_rank": 0, "pcp": 1, "cost": 0.0, "eligible": False, "reason": "draining"},
    ],
    "decode_candidates": [
        {"node_id": "decode-0", "dp_rank": 0, "running": 2, "free_blocks": 54, "eligible": True, "reason": "[chosen]"},
    ],
}


FAILED = [{"node_id": "decode-1", "role": "decode", "at": 1.0,
           "why": "rank 0: Traceback (most recent call last):\n  File ...\nRuntimeError: [gloo] Timed out waiting"}]


class FakeProxy(BaseHTTPRequestHandler):
    nodes: dict[str, dict] = {}
    last_query: dict[str, list[str]] = {}

    def do_GET(self) -> None:
        if not self._authorized():
            return
        url = urlsplit(self.path)
        if url.path == "/admin/nodes":
            self._json(200, {"nodes": list(self.nodes.values()), "failed": FAILED})
        elif url.path == "/admin/route":
            query = parse_qs(url.query)
            tokens = int(query["prompt_tokens"][0])
            FakeProxy.last_query = query
            if tokens > 2048:
                self._error(503, "no prefill replica can take 4096 tokens", "no_route")
            else:
                self._json(200, ROUTE)
        else:
            self._error(404, "not found", "not_found")

    def do_POST(self) -> None:
        if not self._authorized():
            return
        parts = urlsplit(self.path).path.strip("/").split("/")  # admin/nodes/<id>/<action>
        if len(parts) == 4 and parts[:2] == ["admin", "nodes"] and parts[3] in ("drain", "undrain"):
            found = self.nodes.get(parts[2])
            if found is None:
                self._error(404, f"unknown node {parts[2]}", "node_not_found")
                return
            found["draining"] = parts[3] == "drain"
            self._json(200, {"node_id": parts[2], "draining": found["draining"]})
        else:
            self._error(404, "not found", "not_found")

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {ADMIN_KEY}":
            return True
        self._error(401, "invalid admin key", "invalid_api_key")
        return False

    def _error(self, status: int, message: str, code: str) -> None:
        self._json(status, {"error": {"message": message, "type": "invalid_request_error", "code": code}})

    def _json(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def proxy_url() -> Iterator[str]:
    FakeProxy.nodes = {n["node_id"]: n for n in (node("decode-0", "decode", engine="vllm"),
                                                  node("prefill-0", "prefill", ep=2, experts_per_rank=128),
                                                  node("prefill-1", "prefill", healthy=False, draining=True))}
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeProxy)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def pdctl(monkeypatch):
    monkeypatch.setattr(cli.console, "width", 200)  # no wrapping in tables
    monkeypatch.delenv("PDCLUSTER_ADMIN_KEY", raising=False)
    runner = CliRunner()
    return lambda *args, env=None: runner.invoke(cli.app, list(args), env=env)


def test_status_table(pdctl, proxy_url) -> None:
    result = pdctl("status", "--proxy", proxy_url, "--admin-key", ADMIN_KEY)
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"proxy {proxy_url}" in out
    for expected in ("decode-0", "decode (vllm)", "prefill-0", "prefill-1", "EP2, 128 experts/rank",
                     "sharded, fp8_ds_mla, tcp", "fp8 experts, bfloat16", "unhealthy", "draining", "120 / 3",
                     "15 / 113",
                     "decode-1 (decode) failed", "ago and left the cluster: rank 0: Traceback (most recent call "
                     "last): ... RuntimeError: [gloo] Timed out waiting"):
        assert expected in out


def test_nodes_lines_and_json(pdctl, proxy_url) -> None:
    result = pdctl("nodes", "--proxy", proxy_url, "--admin-key", ADMIN_KEY)
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 4
    assert lines[3].startswith("decode-1 (decode) failed") and lines[3].endswith("Timed out waiting")
    assert lines[2].startswith("prefill-1  prefill") and "UNHEALTHY draining" in lines[2] and "inflight=3" in lines[2]
    assert "dp=2 pcp=2 pp=1 ep=2 experts/rank=128  sharded  fp8_ds_mla  weights=fp8experts,bfloat16" in lines[1]
    assert "ep=" not in lines[2]
    raw = pdctl("nodes", "--json", "--proxy", proxy_url, "--admin-key", ADMIN_KEY)
    assert json.loads(raw.output) == {"nodes": list(FakeProxy.nodes.values()), "failed": FAILED}


def test_admin_key_from_the_environment(pdctl, proxy_url) -> None:
    result = pdctl("nodes", "--proxy", proxy_url, env={"PDCLUSTER_ADMIN_KEY": ADMIN_KEY})
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("key", [None, "wrong"])
def test_missing_or_wrong_admin_key(pdctl, proxy_url, key) -> None:
    args = ["status", "--proxy", proxy_url] + (["--admin-key", key] if key else [])
    result = pdctl(*args)
    assert result.exit_code == 1
    assert "refused the admin key (invalid admin key)" in result.output
    assert "PDCLUSTER_ADMIN_KEY" in result.output and "Traceback" not in result.output


def test_drain_and_undrain(pdctl, proxy_url) -> None:
    result = pdctl("drain", "prefill-0", "--proxy", proxy_url, "--admin-key", ADMIN_KEY)
    assert result.exit_code == 0 and "prefill-0: draining" in result.output
    assert FakeProxy.nodes["prefill-0"]["draining"] is True
    result = pdctl("undrain", "prefill-0", "--proxy", proxy_url, "--admin-key", ADMIN_KEY)
    assert result.exit_code == 0 and "prefill-0: not draining" in result.output
    assert FakeProxy.nodes["prefill-0"]["draining"] is False


def test_drain_an_unknown_node(pdctl, proxy_url) -> None:
    result = pdctl("drain", "prefill-9", "--proxy", proxy_url, "--admin-key", ADMIN_KEY)
    assert result.exit_code == 1
    assert "error: unknown node prefill-9" in result.output and "Traceback" not in result.output


def test_route(pdctl, proxy_url) -> None:
    result = pdctl("route", "--prompt-tokens", "100", "--proxy", proxy_url, "--admin-key", ADMIN_KEY)
    assert result.exit_code == 0, result.output
    assert "prefill: prefill-0 replica 1 (PCP 2), cost 120.5: least queued tokens" in result.output
    assert "decode:  decode-0 rank 0: most free KV blocks" in result.output
    assert "draining" in result.output  # the prefill candidates table
    assert "[chosen]" in result.output  # the decode candidates table; text from the proxy is not markup


def test_route_with_max_tokens(pdctl, proxy_url) -> None:
    result = pdctl("route", "--prompt-tokens", "100", "--max-tokens", "64", "--proxy", proxy_url,
                   "--admin-key", ADMIN_KEY)
    assert result.exit_code == 0, result.output
    assert FakeProxy.last_query == {"prompt_tokens": ["100"], "max_tokens": ["64"]}


def test_no_route(pdctl, proxy_url) -> None:
    result = pdctl("route", "--prompt-tokens", "4096", "--proxy", proxy_url, "--admin-key", ADMIN_KEY)
    assert result.exit_code == 1
    assert "answered 503: no prefill replica can take 4096 tokens" in result.output


def test_unreachable_proxy(pdctl) -> None:
    result = pdctl("status", "--proxy", f"http://127.0.0.1:{free_port()}")
    assert result.exit_code == 1
    assert "cannot reach the proxy" in result.output and "Traceback" not in result.output


def test_proxy_from_the_state_file_of_up(pdctl, proxy_url, tmp_path: Path) -> None:
    state = launcher.RunState(cluster="pdcluster", run_dir=str(tmp_path), proxy_url=proxy_url,
                              registry_url="redis://127.0.0.1:1/0", admin_key=True, api_key=False, started_at=0.0)
    launcher.write_state(tmp_path, state)
    result = pdctl("nodes", "--run-dir", str(tmp_path), "--admin-key", ADMIN_KEY)
    assert result.exit_code == 0, result.output
    assert len(result.output.strip().splitlines()) == 3 + len(FAILED)
    assert pdctl("nodes", "--run-dir", str(tmp_path)).exit_code == 1  # no key given, none kept: refused
    (tmp_path / launcher.ADMIN_KEY_FILE).write_text(ADMIN_KEY + "\n")  # as `pdctl up` keeps it
    result = pdctl("nodes", "--run-dir", str(tmp_path))
    assert result.exit_code == 0 and len(result.output.strip().splitlines()) == 3 + len(FAILED), result.output


def test_no_state_and_no_proxy(pdctl, tmp_path: Path) -> None:
    result = pdctl("status", "--run-dir", str(tmp_path / "none"))
    assert result.exit_code == 1 and "pass --proxy URL, or start a cluster with pdctl up" in result.output


# --- `pdctl up` argument checks (nothing is started) ---

def test_up_refuses_topology_with_flags(pdctl, tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("model: m\n")
    result = pdctl("up", "--topology", str(tmp_path / "t.yaml"), "--prefill-pcp", "2", "--model", "m")
    assert result.exit_code == 1
    assert "drop --model, --prefill-pcp" in result.output


def test_up_needs_a_model_or_a_topology(pdctl) -> None:
    result = pdctl("up")
    assert result.exit_code == 2 and "give --model DIR" in result.output


def test_up_reports_bad_values_cleanly(pdctl, tmp_path: Path) -> None:
    result = pdctl("up", "--model", str(tmp_path), "--kv-layout", "mirrored")
    assert result.exit_code == 2 and "kv_layout must be one of" in result.output
    result = pdctl("up", "--model", str(tmp_path), "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 1 and "has no config.json" in result.output


def _flag_topology(pdctl, monkeypatch, *flags: str):
    """The topology ``pdctl up`` builds from ``flags`` (the launcher is not run)."""
    from pdctl import launcher

    seen = []

    def fake_up(topology, run_dir, **kw):
        seen.append(topology)
        raise launcher.LaunchError("stopped by the test")

    monkeypatch.setattr(launcher, "up", fake_up)
    result = pdctl("up", "--model", "/m", "--run-dir", "/nonexistent-run", *flags)
    return (seen[0] if seen else None), result


def test_up_places_gpus_dummy_weights_memory_share_and_proxy_workers(pdctl, monkeypatch) -> None:
    topo, result = _flag_topology(
        pdctl, monkeypatch, "--device", "cuda", "--prefill-nodes", "2", "--prefill-pcp", "2",
        "--prefill-gpus", "0,1,2,3", "--decode-gpus", "3", "--load-format", "dummy",
        "--gpu-memory-utilization", "0.4", "--proxy-workers", "2")
    assert topo is not None, result.output
    assert [p.value("gpus") for p in topo.prefill] == ["0,1", "2,3"]  # consecutive slices, one per node
    assert [d.value("gpus") for d in topo.decode] == ["3"]
    for node in (*topo.prefill, *topo.decode):
        assert node.value("load_format") == "dummy" and node.value("gpu_memory_utilization") == 0.4
    assert topo.proxy.workers == 2


def test_up_with_no_prefill_nodes_is_a_colocated_cluster(pdctl, monkeypatch) -> None:
    topo, result = _flag_topology(pdctl, monkeypatch, "--prefill-nodes", "0")
    assert topo is not None, result.output
    assert topo.prefill == () and len(topo.decode) == 1


@pytest.mark.parametrize(("flags", "message"), [
    (("--prefill-nodes", "2", "--prefill-gpus", "0,1,2"), "lists 3 GPUs for 2 nodes"),
    (("--decode-gpus", "a,b"), "comma-separated GPU numbers"),
    (("--prefill-nodes", "0", "--prefill-gpus", "0"), "no such nodes"),
])
def test_up_refuses_gpu_lists_that_do_not_divide(pdctl, monkeypatch, flags, message) -> None:
    topo, result = _flag_topology(pdctl, monkeypatch, *flags)
    assert topo is None and result.exit_code == 2 and message in result.output

