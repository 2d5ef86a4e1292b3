"""vllm-router drives PdKVConnector: vLLM's own PD router in front of two vLLM OpenAI servers.

``vllm-router --vllm-pd-disaggregation --kv-connector nixl`` sends each request to the prefill
server with ``kv_transfer_params={"do_remote_decode": true}`` and ``max_tokens=1``, then to the
decode server with the params the prefill answered: the NIXL conventions our connector follows.
The decode server's ``vllm:prompt_tokens_by_source{source="external_kv_transfer"}`` shows that the
prompt's KV was loaded through the connector rather than computed there.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from vllm_common import MAX_TOKENS, PROMPTS, free_port

from engine.tokenizer import Tokenizer

ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
pytestmark = pytest.mark.skipif(ROUTER is None, reason="no vllm-router (scripts/test_vllm.sh installs it)")
START_S = 400.0


def _server(model: Path, port: int, role: str, log: Path) -> subprocess.Popen:
    kv = {"kv_connector": "PdKVConnector", "kv_connector_module_path": "vllm_backend.connector",
          "kv_role": role, "kv_connector_extra_config": {"side_channel_port": free_port()}}
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny", "--dtype", "float32",
            "--max-model-len", "256", "--enforce-eager", "--block-size", "16", "--no-enable-prefix-caching",
            "--kv-cache-memory-bytes", str(64 << 20), "--attention-backend", "CPU_MLA",  # float32: not AMX's
            "--kv-transfer-config", json.dumps(kv)]
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args[0]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} not healthy in {START_S:.0f} s:\n{log.read_text()[-3000:]}")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


@pytest.fixture(scope="module")
def urls(mla_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(router URL, decode server URL)."""
    logs = tmp_path_factory.mktemp("vllm-router")
    ports = {name: free_port() for name in ("prefill", "decode")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    procs = [_server(mla_model, ports["prefill"], "kv_producer", logs / "prefill.log"),
             _server(mla_model, ports["decode"], "kv_consumer", logs / "decode.log")]
    try:
        deadline = time.monotonic() + START_S
        for name, proc in zip(("prefill", "decode"), procs):
            _wait_healthy(url[name], proc, logs / f"{name}.log", deadline)
        # The router's ports are picked only now: the servers open sockets of their own while they start, and
        # one took a router port picked before them once ("Address already in use" on CI).
        ports["router"] = free_port()
        url["router"] = f"http://127.0.0.1:{ports['router']}"
        metrics = free_port()
        while metrics == ports["router"]:  # (nothing holds either yet: the same one can come back)
            metrics = free_port()
        procs.append(subprocess.Popen(
            [ROUTER, "--vllm-pd-disaggregation", "--prefill", url["prefill"], "--decode", url["decode"],
             "--host", "127.0.0.1", "--port", str(ports["router"]), "--kv-connector", "nixl",
             # its metrics exporter's default port (29000) may be taken by another router on this host
             "--prometheus-port", str(metrics)],
            stdout=(logs / "router.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True))
        _wait_healthy(url["router"], procs[-1], logs / "router.log", time.monotonic() + 60)
        yield url["router"], url["decode"]
    finally:
        _stop(procs)


def _loaded_tokens(decode_url: str) -> float:
    """Prompt tokens the decode server got through its KV connector."""
    for line in httpx.get(f"{decode_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="external_kv_transfer"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("the decode server has no vllm:prompt_tokens_by_source metric")


def test_vllm_router_drives_the_connector(urls: tuple[str, str], colocated: list[list[int]], mla_model: Path) -> None:
    router, decode = urls
    tok = Tokenizer(str(mla_model))
    before = _loaded_tokens(decode)
    for prompt, want in zip(PROMPTS, colocated, strict=True):
        r = httpx.post(f"{router}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == want
        assert tok.decode(want).startswith(choice["text"])  # vLLM holds back a trailing partial character
    assert _loaded_tokens(decode) - before == sum(len(p) for p in PROMPTS)
