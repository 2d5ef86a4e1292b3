"""One proxy process (as ``python -m proxy`` runs) on fast fake nodes: 1,000 concurrent streams end
without an error, its memory stays bounded across rounds, and nothing stays in flight; and a corpus
of malformed requests generated from the request models never gets a 5xx."""

from __future__ import annotations

import asyncio
import json
import resource
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxy_fakes import FakeDecode, FakeNodes, FakePrefill, Script, heartbeating, node_state, wait_until

from cluster.config import RegistryConfig
from cluster.net import free_port
from cluster.registry import Registry
from engine.tokenizer import Tokenizer
from pdctl.redis_server import start_redis
from proxy.api.protocol import ChatCompletionRequest, CompletionRequest
from proxy.api.responses_api import ResponsesRequest

MODEL = "tiny-load"
STREAMS = 1000


@pytest.fixture(scope="module")
def proxy(tiny_model: Path) -> Iterator[tuple[str, psutil.Process]]:
    """Redis, a fake prefill and decode node heartbeating into it, and ``python -m proxy``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 8192)  # 1,000 client sockets here and 1,000 accepted ones in the proxy (it inherits it)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    tok = Tokenizer(tiny_model)
    script = Script(tok.encode("Hello from the fake nodes, sixteen tokens or so.", add_special_tokens=False),
                    tok.eos_token_id)
    fakes = FakeNodes()
    redis = start_redis()
    registry = Registry(RegistryConfig(url=redis.url, cluster="load", ttl_s=3, heartbeat_s=0.3))
    states = [node_state("p0", "prefill", fakes.serve(FakePrefill("p0", script)), model=MODEL, max_model_len=256),
              node_state("d0", "decode", fakes.serve(FakeDecode("d0", script)), model=MODEL, max_model_len=256,
                         num_blocks=1 << 20)]
    beats = ExitStack()
    beats.enter_context(heartbeating(registry, states))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "--model", str(tiny_model), "--served-model-name", MODEL,
                             "--port", str(port), "--registry-url", redis.url, "--cluster", "load",
                             "--log-level", "warning"], cwd=Path(__file__).parents[2])
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(healthy, 60), "the proxy never became healthy"
        yield url, psutil.Process(proc.pid)
    finally:
        proc.terminate()
        proc.wait(15)
        beats.close()
        registry.close()
        redis.stop()
        fakes.stop()


async def _streams(url: str, n: int) -> list[str]:
    """``n`` concurrent streamed completions; each one's outcome ("ok" or what went wrong)."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as client:
        async def one(i: int) -> str:
            body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": 16, "stream": True}
            try:
                async with client.post("/v1/completions", json=body) as r:
                    if r.status != 200:
                        return f"HTTP {r.status}"
                    last = ""
                    async for raw in r.content:
                        line = raw.decode().strip()
                        if line.startswith("data: "):
                            last = line[6:]
                            if last.startswith("{") and "error" in json.loads(last):
                                return f"error event: {last}"
                    return "ok" if last == "[DONE]" else f"ended with {last!r}"
            except (TimeoutError, aiohttp.ClientError) as e:
                return f"{type(e).__name__}: {e}"

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_a_thousand_concurrent_streams_through_one_proxy(proxy: tuple[str, psutil.Process]) -> None:
    url, proc = proxy
    rss = []
    for _ in range(3):
        outcomes = asyncio.run(_streams(url, STREAMS))
        bad = [o for o in outcomes if o != "ok"]
        assert not bad, f"{len(bad)} of {STREAMS} streams failed, e.g. {bad[:3]}"
        rss.append(proc.memory_info().rss)
    assert rss[2] - rss[0] < 40 * 2**20, f"RSS grew {(rss[2] - rss[0]) / 2**20:.0f} MiB over two rounds"
    page = httpx.get(f"{url}/metrics", timeout=10).text
    assert "pdcluster_proxy_inflight_requests 0.0" in page


# -- malformed requests ------------------------------------------------------------------------------
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
                     | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _bodies(model: type) -> st.SearchStrategy[dict]:
    """Objects with the model's fields (and strangers) holding any JSON value, around a valid core."""
    fields = sorted(model.model_fields)
    return st.dictionaries(st.sampled_from(fields) | st.text(max_size=10), _JSON, max_size=8).map(
        lambda d: {"model": MODEL, **d})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completion=_bodies(CompletionRequest), chat=_bodies(ChatCompletionRequest),
       responses=_bodies(ResponsesRequest), raw=st.binary(max_size=64))
def test_malformed_requests_never_get_a_5xx(proxy: tuple[str, psutil.Process], completion: dict, chat: dict,
                                            responses: dict, raw: bytes) -> None:
    url, _ = proxy
    with httpx.Client(base_url=url, timeout=30) as http:
        for path, content in (("/v1/completions", json.dumps(completion)), ("/v1/chat/completions", json.dumps(chat)),
                              ("/v1/responses", json.dumps(responses)), ("/v1/completions", raw)):
            r = http.post(path, content=content, headers={"content-type": "application/json"})
            assert r.status_code < 500, (path, content, r.status_code, r.text)
            if r.status_code >= 400:
                assert set(r.json()["error"]) >= {"message", "type", "code"}  # OpenAI's shape
