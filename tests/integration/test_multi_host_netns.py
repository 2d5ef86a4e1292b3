"""The cluster across "hosts": network namespaces joined by veth pairs, nothing on loopback between them.

Namespaces (their own network stacks): a hub with Redis and the proxy (198.18.0.1), a prefill node
(.2) and two decode nodes (.3, .4), each with one veth into a bridge in a fifth namespace (the
switch); nothing is routed anywhere else. Every process listens on and advertises its namespace's
address, as on separate hosts, so a component that bound or advertised 127.0.0.1 could not be
reached and the tests would fail. The openai client runs inside the hub namespace. Needs root and
``ip`` (iproute2, which scripts/setup.sh installs): it skips without them, and fails under CI; the
fixture deletes every namespace it made (their links go with them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from pdctl.redis_server import redis_server_binary

NET = "198.18.0"  # RFC 2544's benchmarking range: never routed
ADMIN = "netns-admin"
TOKEN = "netns-cluster-token"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no ip command (iproute2)"
    probe = f"pdprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"cannot make a network namespace here: {e}"
    return None


@dataclass
class Hosts:
    names: dict[str, str]  # role -> namespace
    procs: dict[str, subprocess.Popen[bytes]]
    logs: Path
    model: Path

    def run_in_hub(self, code: str, timeout_s: float = 120) -> str:
        """Python code run inside the hub namespace (where the proxy listens); its stdout."""
        r = subprocess.run(["ip", "netns", "exec", self.names["hub"], sys.executable, "-c", textwrap.dedent(code)],
                           capture_output=True, text=True, timeout=timeout_s, env=_env())
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout

    def nodes(self) -> dict[str, dict]:
        out = self.run_in_hub(f"""
            import httpx, json
            r = httpx.get("http://{NET}.1:8000/admin/nodes", headers={{"Authorization": "Bearer {ADMIN}"}}, timeout=10)
            print(json.dumps(r.json()))""")
        return {n["node_id"]: n for n in json.loads(out)["nodes"]}


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PDCLUSTER_CLUSTER_TOKEN": TOKEN, "PDCLUSTER_ADMIN_KEY": ADMIN}


@pytest.fixture(scope="module")
def hosts(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    why = _why_not()
    if why:
        if os.environ.get("CI"):  # CI runs as root with iproute2 (scripts/setup.sh): this must run there
            pytest.fail(why)
        pytest.skip(why)
    tag = f"pd{os.getpid() % 100000}"
    names = {role: f"{tag}{role}" for role in ("sw", "hub", "pre", "d0", "d1")}
    addr = {"hub": f"{NET}.1", "pre": f"{NET}.2", "d0": f"{NET}.3", "d1": f"{NET}.4"}
    logs = tmp_path_factory.mktemp("netns-logs")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    made: list[str] = []
    try:
        for ns in names.values():
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", "br0", "type", "bridge", ns=names["sw"])
        _ip("link", "set", "br0", "up", ns=names["sw"])
        for role, ip in addr.items():
            inner, outer = f"{tag}{role}i"[-15:], f"{tag}{role}o"[-15:]
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", inner, "netns", names[role])
            _ip("link", "set", outer, "netns", names["sw"])
            _ip("link", "set", outer, "master", "br0", "up", ns=names["sw"])
            _ip("addr", "add", f"{ip}/24", "dev", inner, ns=names[role])
            _ip("link", "set", inner, "up", ns=names[role])
            _ip("link", "set", "lo", "up", ns=names[role])  # a node's own rank processes talk on it
        model = str(tiny_model)
        registry = f"redis://{addr['hub']}:6379/0"
        node = ["--registry-url", registry, "--cluster", tag, "--served-model-name", "tiny", "--dtype", "float32",
                "--device", "cpu", "--max-model-len", "1024", "--num-kv-blocks", "256"]
        commands = {
            "redis": ("hub", [str(redis_server_binary()), "--bind", addr["hub"], "--port", "6379", "--save", "",
                              "--appendonly", "no", "--protected-mode", "no"]),
            "proxy": ("hub", [sys.executable, "-m", "proxy", "--model", model, "--served-model-name", "tiny",
                              "--host", addr["hub"], "--port", "8000", "--registry-url", registry, "--cluster", tag,
                              "--token-timeout-s", "5", "--health-probe-s", "0.5"]),
            "prefill": ("pre", [sys.executable, "-m", "prefill_node", "--model", model, "--node-id", "prefill-0",
                                "--host", addr["pre"], "--port", "50051", "--advertise-host", addr["pre"],
                                "--lease-s", "5", *node]),
            **{f"decode-{i}": (f"d{i}", [sys.executable, "-m", "decode_node", "--model", model,
                                         "--node-id", f"decode-{i}", "--host", addr[f"d{i}"], "--port", "50052",
                                         "--advertise-host", addr[f"d{i}"], "--transfer-timeout-s", "5", *node])
               for i in (0, 1)},
        }
        for name, (role, cmd) in commands.items():
            log = open(logs / f"{name}.log", "wb")  # noqa: SIM115 - the process writes to it until the end
            procs[name] = subprocess.Popen(["ip", "netns", "exec", names[role], *cmd], stdout=log,
                                           stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
        h = Hosts(names, procs, logs, tiny_model)
        deadline = time.monotonic() + 180
        while True:
            try:
                nodes = h.nodes()
                if {"prefill-0", "decode-0", "decode-1"} <= {k for k, n in nodes.items() if n["healthy"]}:
                    break
            except AssertionError:
                pass  # the proxy is not up yet
            dead = [n for n, p in procs.items() if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, f"cluster did not come up (dead: {dead}; logs {logs})"
            time.sleep(1)
        yield h
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs.values():
            p.wait(timeout=30)
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(ns in left for ns in made), left


PROMPT = [(i * 19 + 7) % 1000 + 2 for i in range(90)]


def test_the_openai_client_gets_the_colocated_text_across_namespaces(hosts: Hosts) -> None:
    out = hosts.run_in_hub(f"""
        import json, openai
        c = openai.OpenAI(base_url="http://{NET}.1:8000/v1", api_key="x", max_retries=0, timeout=60)
        got = []
        for _ in range(3):
            r = c.completions.create(model="tiny", prompt={PROMPT}, max_tokens=8, temperature=0, logprobs=0,
                                     extra_body={{"ignore_eos": True, "return_tokens_as_token_ids": True}})
            got.append([int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens])
        print(json.dumps(got))""")
    with LLM(str(hosts.model), dtype="float32", device="cpu", max_model_len=1024) as llm:
        want = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    assert json.loads(out) == [want] * 3
    nodes = hosts.nodes()
    assert {n["address"].rsplit(":", 1)[0] for n in nodes.values()} == {f"{NET}.2", f"{NET}.3", f"{NET}.4"}


def test_a_decode_hosts_link_going_down_mid_stream_is_a_dead_node(hosts: Hosts) -> None:
    """The stream ends with an error, the prefill node frees the KV at its lease, new requests go to
    the other decode node."""
    code = f"""
        import httpx, json, subprocess, sys
        admin = {{"Authorization": "Bearer {ADMIN}"}}
        httpx.post("http://{NET}.1:8000/admin/nodes/decode-1/drain", headers=admin, timeout=10)
        body = {{"model": "tiny", "prompt": {PROMPT}, "max_tokens": 900, "temperature": 0, "stream": True,
                 "ignore_eos": True}}
        events = 0
        last = None
        with httpx.stream("POST", "http://{NET}.1:8000/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {{"):
                    continue
                events += 1
                last = json.loads(line[6:])
                if events == 3:  # decode-0's host drops off the network
                    subprocess.run(["ip", "netns", "exec", sys.argv[1], "ip", "link", "set", sys.argv[2], "down"],
                                   check=True)
                    httpx.post("http://{NET}.1:8000/admin/nodes/decode-1/undrain", headers=admin, timeout=10)
        print(json.dumps({{"events": events, "last": last}}))
    """
    d0 = hosts.names["d0"]
    r = subprocess.run(["ip", "netns", "exec", hosts.names["hub"], sys.executable, "-c", textwrap.dedent(code), d0,
                        f"{d0[:-2]}d0i"[-15:]], capture_output=True, text=True, timeout=120, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert result["events"] >= 3 and "error" in result["last"], result
    deadline = time.monotonic() + 20  # the prefill node's 5 s lease, then a heartbeat
    while time.monotonic() < deadline:
        used = sum(x["used_blocks"] for x in hosts.nodes()["prefill-0"]["replicas"])
        if used == 0:
            break
        time.sleep(0.5)
    assert used == 0
    out = hosts.run_in_hub(f"""
        import openai
        c = openai.OpenAI(base_url="http://{NET}.1:8000/v1", api_key="x", max_retries=0, timeout=60)
        for _ in range(3):
            r = c.completions.create(model="tiny", prompt={PROMPT}, max_tokens=4, temperature=0)
            assert r.usage.completion_tokens == 4
        print("ok")""")
    assert out.strip() == "ok"
