"""``python -m proxy`` as a process: wired to a real Redis registry, routing to fake nodes.

The fake nodes register through ``cluster.registry.Registry`` as real nodes do; the proxy finds
them there, serves a request, and drains a node through Redis.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from proxy_fakes import FakeDecode, FakeNodes, FakePrefill, Script, heartbeating, node_state, wait_until

from cluster.config import RegistryConfig
from cluster.net import free_port
from cluster.registry import Registry
from engine.tokenizer import Tokenizer
from pdctl.redis_server import start_redis
from proxy.metrics import FLUSH_S

MODEL = "tiny-main"
ADMIN_KEY = "adm"


@pytest.fixture
def registered_fakes(tiny_model: Path) -> Iterator[tuple[str, FakePrefill, FakeDecode]]:
    """Redis, and one fake prefill and decode node heartbeating into it; yields the Redis URL."""
    tok = Tokenizer(tiny_model)
    script = Script(tok.encode("Hello from the fake nodes.", add_special_tokens=False), tok.eos_token_id)
    fakes = FakeNodes()
    try:
        with start_redis() as redis_server:
            registry = Registry(RegistryConfig(url=redis_server.url, cluster="proxytest", ttl_s=3, heartbeat_s=0.3))
            p, d = FakePrefill("p0", script), FakeDecode("d0", script)
            states = [node_state("p0", "prefill", fakes.serve(p), model=MODEL, max_model_len=256),
                      node_state("d0", "decode", fakes.serve(d), model=MODEL, max_model_len=256)]
            try:
                with heartbeating(registry, states):
                    yield redis_server.url, p, d
            finally:
                registry.close()
    finally:
        fakes.stop()


@contextmanager
def running_proxy(tiny_model: Path, redis_url: str, *extra: str,
                  log: Path | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``python -m proxy`` on a free port, healthy; stopped with SIGTERM as a process manager would.
    ``log``: where its output goes (default: the test's)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = None if log is None else log.open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "--model", str(tiny_model), "--served-model-name", MODEL,
         "--port", str(port), "--registry-url", redis_url, "--cluster", "proxytest", "--admin-key", ADMIN_KEY,
         "--refresh-s", "0.2", "--log-level", "warning", *extra],
        cwd=Path(__file__).parents[2], env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=out, stderr=None if out is None else subprocess.STDOUT,
    )
    try:
        assert wait_until(lambda: _healthy(url), 60), "the proxy never became healthy"
        yield url, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            # the server stops its workers gracefully and exits 0
            assert proc.wait(15) in (0, -signal.SIGTERM)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if out is not None:
                out.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_main_serves_from_the_registry(tiny_model: Path, registered_fakes: tuple[str, FakePrefill, FakeDecode]) -> None:
    redis_url, p0, d0 = registered_fakes
    with running_proxy(tiny_model, redis_url) as (url, _):
        r = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0).completions.create(
            model=MODEL, prompt="hi", max_tokens=50)
        assert r.choices[0].text == "Hello from the fake nodes." and r.choices[0].finish_reason == "stop"
        assert len(p0.requests) == 1 and len(d0.requests) == 1

        admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5)
        assert admin.post("/admin/nodes/p0/drain").json() == {"node_id": "p0", "draining": True}
        assert httpx.get(f"{url}/health").status_code == 503  # at once, not after the next refresh
        registry = Registry(RegistryConfig(url=redis_url, cluster="proxytest"))
        assert next(n for n in registry.nodes() if n.info.node_id == "p0").draining  # written through Redis
        registry.close()
        assert admin.post("/admin/nodes/p0/undrain").status_code == 200
        assert wait_until(lambda: _healthy(url), 5)
        admin.close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_cancels_its_decode(tiny_model: Path, stream: bool,
                                                 registered_fakes: tuple[str, FakePrefill, FakeDecode]) -> None:
    """Through the server as deployed (not only the app under test servers): a client gone mid-decode
    ends the decode stream and aborts the prefill's lease."""
    redis_url, p0, d0 = registered_fakes
    d0.delay_s, d0.tokens_per_event = 0.1, 1
    body = json.dumps({"model": MODEL, "prompt": "x", "stream": stream}).encode()
    with running_proxy(tiny_model, redis_url) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert wait_until(lambda: len(d0.requests) == 1)
            time.sleep(0.15)
        rid = d0.requests[0].request_id
        assert wait_until(lambda: rid in d0.cancelled), "the decode stream was not cancelled"
        assert wait_until(lambda: rid in p0.aborts), "no Abort reached the prefill node"
        assert rid not in d0.finished


def test_access_log_is_on_at_info_off_above_and_can_be_turned_off(
        tiny_model: Path, registered_fakes: tuple[str, FakePrefill, FakeDecode], tmp_path: Path) -> None:
    redis_url, _, _ = registered_fakes
    for level, flags, expected in (("info", (), True), ("info", ("--no-access-log",), False), ("warning", (), False)):
        log = tmp_path / f"proxy-{level}{len(flags)}.log"
        with running_proxy(tiny_model, redis_url, "--log-level", level, *flags, log=log) as (url, _):
            r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 5}, timeout=30)
            assert r.status_code == 200
        assert ('"POST /v1/completions HTTP/1.1" 200' in log.read_text()) is expected, log.read_text()[-2000:]


def test_several_workers_share_the_port_the_metrics_and_the_drain_flags(
        tiny_model: Path, registered_fakes: tuple[str, FakePrefill, FakeDecode]) -> None:
    redis_url, p0, d0 = registered_fakes
    with running_proxy(tiny_model, redis_url, "--workers", "2") as (url, proc):
        workers = [w for w in psutil.Process(proc.pid).children(recursive=True)
                   if "spawn_main" in " ".join(w.cmdline())]
        assert len(workers) == 2
        for w in workers:  # the tokenizer without torch (proxy.workers.without_torch)
            assert not any("libtorch" in m.path for m in w.memory_maps()), "a proxy worker loaded torch"
        if len(os.sched_getaffinity(0)) >= 2:  # each on a core of its own (proxy.affinity)
            cores = [w.cpu_affinity() for w in workers]
            assert all(len(c) == 1 for c in cores) and cores[0] != cores[1], cores
        n = 12
        for i in range(n):  # a new connection each: the kernel spreads them over the workers
            with httpx.Client(base_url=url, timeout=10) as c:
                r = c.post("/v1/completions", json={"model": MODEL, "prompt": f"hi {i}", "max_tokens": 50,
                                                    "stream": i % 2 == 0})
                assert r.status_code == 200, r.text
        assert len(p0.requests) == n and len(d0.requests) == n
        # Every worker answers /metrics with every worker's series summed: the others' as of their last
        # flush of the request path's tallies (every FLUSH_S), its own as of now.
        time.sleep(FLUSH_S + 0.5)
        for _ in range(4):
            page = httpx.get(f"{url}/metrics", timeout=5).text
            line = next(x for x in page.splitlines()
                        if x.startswith('pdcluster_proxy_requests_total{endpoint="/v1/completions",status="200"}'))
            assert float(line.split()[-1]) == n
            assert "pdcluster_proxy_inflight_requests 0.0" in page
        # A drain through one worker reaches the others through the registry's notification.
        admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5)
        assert admin.post("/admin/nodes/d0/drain").status_code == 200
        time.sleep(1.0)
        assert all(httpx.get(f"{url}/health", timeout=5).status_code == 503 for _ in range(8))
        assert admin.post("/admin/nodes/d0/undrain").status_code == 200
        admin.close()
    # The workers (and multiprocessing's resource tracker, which follows its parent out) are gone.
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, alive


def test_a_model_that_cannot_be_loaded_stops_the_proxy_with_an_error(tmp_path: Path) -> None:
    """No model directory: the proxy says so before it starts a worker. A directory whose tokenizer
    cannot be loaded: each worker fails as it builds its app, and the proxy stops with an error
    instead of restarting them for ever."""
    half = tmp_path / "config-only"
    half.mkdir()
    (half / "config.json").write_text('{"max_position_embeddings": 128}')
    for model, expected in ((tmp_path / "none", "cannot load the model"), (half, "could not start")):
        r = subprocess.run([sys.executable, "-m", "proxy", "--model", str(model), "--workers", "2",
                            "--port", str(free_port()), "--log-level", "warning"],
                           cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0
        assert expected in r.stderr, r.stderr[-2000:]
