"""The `pdctl up` topology: YAML parsing, validation, and the command lines the launcher builds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pdctl.launcher import cluster_commands, decode_command, prefill_command, proxy_command
from pdctl.topology import DecodeSpec, PrefillSpec, ProxySpec, RegistrySpec, Topology, load_topology

EXAMPLE = """
model: ./tiny
served_model_name: tiny-chat
node_host: 127.0.0.1
registry:
  url: null
  cluster: demo
proxy: {host: 0.0.0.0, port: 8100, admin_key: sesame}
prefill:
  - {dp: 2, pcp: 2, pp: 1, kv_layout: sharded, kv_interleave: 32, num_kv_blocks: 128}
  - {pcp: 1, kv_layout: replicated, lease_s: 5}
decode:
  - {dp: 2, max_num_seqs: 64, transfer_timeout_s: 7.5}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "topology.yaml"
    path.write_text(text)
    return path


def test_example_yaml(tmp_path) -> None:
    t = load_topology(write(tmp_path, EXAMPLE))
    assert t.model == str(tmp_path / "tiny")  # relative to the file, not the cwd
    assert t.cluster == "demo" and t.registry.url is None
    assert t.proxy == ProxySpec(host="0.0.0.0", port=8100, admin_key="sesame")
    assert t.prefill == (PrefillSpec(dp=2, pcp=2, kv_interleave=32, num_kv_blocks=128),
                         PrefillSpec(kv_layout="replicated", lease_s=5))
    assert t.decode == (DecodeSpec(dp=2, max_num_seqs=64, transfer_timeout_s=7.5),)


def test_defaults_suit_the_tiny_cpu_model() -> None:
    t = Topology(model="/m")
    assert len(t.prefill) == len(t.decode) == 1
    for spec in (t.prefill[0], t.decode[0]):
        assert tuple(spec.value(k) for k in ("dtype", "device", "max_model_len", "port")) == ("float32", "cpu", 2048, 0)
    assert t.registry == RegistrySpec() and t.cluster == "pdcluster"


def test_minimal_yaml_and_absolute_model(tmp_path) -> None:
    t = load_topology(write(tmp_path, "model: /models/tiny\n"))
    assert t == Topology(model="/models/tiny")


@pytest.mark.parametrize(("text", "message"), [
    ("prefill: [{}]\n", "'model'"),
    ("model: m\nprefil: []\n", r"unknown keys \['prefil'\]"),
    ("model: m\ndecode: []\n", "at least one decode node"),
    ("model: m\nprefill: []\ndecode: [{engine: vllm}]\n", "needs native decode nodes"),
    ("model: m\nproxy: {local_prefill_max_tokens: -1}\n", "local_prefill_max_tokens must be an int >= 0"),
    ("model: m\nproxy: {workers: -2}\n", "proxy.workers must be an int >= 0"),
    ("model: m\nproxy: {access_log: 0}\n", "proxy.access_log must be true or false"),
    ("model: m\nproxy: {pin_workers: yes please}\n", "proxy.pin_workers must be true or false"),
    ("model: m\nproxy: {token_timeout_s: 0}\n", "proxy.token_timeout_s must be a number > 0"),
    ("model: m\nprefill: [{dp: 0}]\n", r"prefill\[0\]: dp must be an integer > 0"),
    ("model: m\nprefill: [{pcp: 1.5}]\n", r"prefill\[0\]: pcp must be an integer > 0"),
    ("model: m\nprefill: [{pp: true}]\n", r"prefill\[0\]: pp must be an integer > 0"),
    ("model: m\nprefill: [{}, {kv_layout: mirrored}]\n", r"prefill\[1\]: kv_layout must be one of"),
    ("model: m\nprefill: [{kv_interleave: 0}]\n", "kv_interleave must be an integer > 0 or null"),
    ("model: m\nprefill: [{dtype: fp8}]\n", "dtype must be one of"),
    ("model: m\ndecode: [{device: tpu}]\n", r"decode\[0\]: device must be"),
    ("model: m\ndecode: [{lease_s: 3}]\n", r"decode\[0\]: unknown keys \['lease_s'\]"),
    ("model: m\ndecode: [{transfer_timeout_s: 0}]\n", "transfer_timeout_s must be a number > 0"),
    ("model: m\ndecode: [{grace_s: 60}]\n", r"decode\[0\]: grace_s must be in \[0, 30\] \(pdctl down kills"),
    ("model: m\ndecode: {dp: 2}\n", "decode: expected a list"),
    ("model: m\nproxy: {port: 70000}\n", r"proxy: port must be a port"),
    ("model: m\nproxy: {admin_key: ''}\n", "admin_key must be non-empty"),
    ("model: m\nregistry: {url: 'http://x'}\n", "registry.url must be redis://"),
    ("model: m\nregistry: {url: 'redis://x:1', port: 7000}\n", "either url or port"),
    ("model: m\nregistry: {cluster: 'a:b'}\n", "registry.cluster must be"),
    ("model: m\nregistry: {ttl_s: 1}\n", "registry.ttl_s must be a number of seconds > 1"),
    ("- model: m\n", "mapping at the top level"),
    ("model: [unclosed\n", "not valid YAML"),
])
def test_bad_topologies_say_what_is_wrong(tmp_path, text, message) -> None:
    with pytest.raises(ValueError, match=message):
        load_topology(write(tmp_path, text))


def test_missing_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot read topology"):
        load_topology(tmp_path / "nope.yaml")


# --- command lines ---

URL = "redis://127.0.0.1:7001/0"


def test_prefill_command_line(tmp_path) -> None:
    t = load_topology(write(tmp_path, EXAMPLE))
    spec = prefill_command(t, 0, URL, python="py")
    assert spec.name == "prefill-0" and spec.port is None
    assert list(spec.argv) == [
        "py", "-m", "prefill_node", "--model", str(tmp_path / "tiny"), "--served-model-name", "tiny-chat",
        "--node-id", "prefill-0",
        "--host", "127.0.0.1", "--port", "0", "--registry-url", URL, "--cluster", "demo",
        # the spec's engine overrides in EngineConfig's order; the node's defaults (pp 1, sharded, lease_s 30) left out
        "--dtype", "float32", "--device", "cpu", "--max-model-len", "2048", "--num-kv-blocks", "128",
        "--dp", "2", "--pcp", "2", "--kv-interleave", "32",
    ]
    second = prefill_command(t, 1, URL, python="py").argv
    assert "--kv-interleave" not in second and "--num-kv-blocks" not in second  # optional flags left out
    assert second[second.index("--lease-s") + 1] == "5"


def test_decode_command_line() -> None:
    t = Topology(model="/m", decode=(DecodeSpec(dp=2, num_kv_blocks=64, port=9100, transfer_timeout_s=7.5),))
    spec = decode_command(t, 0, URL, python="py")
    assert spec.name == "decode-0" and spec.port == 9100
    assert list(spec.argv) == [
        "py", "-m", "decode_node", "--model", "/m", "--node-id", "decode-0", "--host", "127.0.0.1",
        "--port", "9100", "--registry-url", URL, "--cluster", "pdcluster", "--dtype", "float32",
        "--device", "cpu", "--max-model-len", "2048", "--num-kv-blocks", "64", "--dp", "2",
        "--transfer-timeout-s", "7.5",
    ]
    assert "--ttl-s" not in spec.argv  # the nodes' own default
    slow = Topology(model="/m", registry=RegistrySpec(ttl_s=30))
    argv = decode_command(slow, 0, URL, python="py").argv
    assert argv[argv.index("--ttl-s") + 1] == "30"


def test_proxy_command_line(tmp_path) -> None:
    t = load_topology(write(tmp_path, EXAMPLE))
    spec = proxy_command(t, URL, port=8100, python="py")
    assert list(spec.argv) == [
        "py", "-m", "proxy", "--model", str(tmp_path / "tiny"), "--served-model-name", "tiny-chat",
        "--host", "0.0.0.0", "--port", "8100", "--registry-url", URL, "--cluster", "demo",
    ]
    assert dict(spec.env) == {"PDCLUSTER_ADMIN_KEY": "sesame"}  # keys travel in the environment, not in ps
    bare = proxy_command(Topology(model="/m"), URL, port=8000, python="py")
    assert "--served-model-name" not in bare.argv and not bare.env and "--workers" not in bare.argv
    workers = proxy_command(Topology(model="/m", proxy=ProxySpec(workers=4, token_timeout_s=3)), URL, port=8000,
                            python="py")
    assert workers.argv[-4:] == ("--workers", "4", "--token-timeout-s", "3")
    quiet = proxy_command(Topology(model="/m", proxy=ProxySpec(access_log=False)), URL, port=8000, python="py")
    assert quiet.argv[-1] == "--no-access-log" and "--no-access-log" not in bare.argv
    loose = proxy_command(Topology(model="/m", proxy=ProxySpec(pin_workers=False)), URL, port=8000, python="py")
    assert loose.argv[-1] == "--no-pin-workers" and "--no-pin-workers" not in bare.argv


def test_cluster_commands_order_and_ids() -> None:
    t = Topology(model="/m", prefill=(PrefillSpec(),) * 2, decode=(DecodeSpec(),) * 3)
    specs = cluster_commands(t, URL, proxy_port=8000)
    assert [s.name for s in specs] == ["prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2", "proxy"]
    assert all(s.argv[0] == sys.executable for s in specs)


def test_command_lines_parse_with_the_real_parsers(tmp_path) -> None:
    """The contract with the node and proxy entry points: what we start, they accept."""
    node_cli = pytest.importorskip("node_runtime.cli")
    proxy_cli = pytest.importorskip("proxy.cli")
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text("{}")
    t = load_topology(write(tmp_path, EXAMPLE))
    for spec in cluster_commands(t, URL, proxy_port=8100):
        args = list(spec.argv[3:])
        if spec.name == "proxy":
            with pytest.MonkeyPatch.context() as mp:
                for k, v in spec.env:
                    mp.setenv(k, v)
                config, _ = proxy_cli.parse_args(args)
            assert (config.port, config.admin_key, config.registry.cluster) == (8100, "sesame", "demo")
        else:
            node, served = node_cli.parse(spec.name.split("-")[0], args)
            assert node.node_id == spec.name and served == "tiny-chat" and node.registry.url == URL
    node, _ = node_cli.parse("prefill", list(prefill_command(t, 0, URL).argv[3:]))
    assert (node.engine.dp, node.engine.pcp, node.engine.kv_interleave, node.engine.num_kv_blocks) == (2, 2, 32, 128)


def test_vllm_engine_nodes(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_VENV", "/venvs/v")
    t = Topology.from_dict({"model": "/m", "engine": "vllm"})
    specs = cluster_commands(t, URL, proxy_port=8000)
    nodes, proxy = specs[:-1], specs[-1]
    assert all(s.argv[0] == "/venvs/v/bin/python" and "--engine" in s.argv and
               s.argv[s.argv.index("--engine") + 1] == "vllm" for s in nodes)
    assert proxy.argv[0] == sys.executable and "--engine" not in proxy.argv
    t = Topology(model="/m", engine="vllm", vllm_python="/py")
    assert {s.argv[0] for s in cluster_commands(t, URL, proxy_port=8000)[:-1]} == {"/py"}
    assert "--engine" not in cluster_commands(Topology(model="/m"), URL, proxy_port=8000)[0].argv
    with pytest.raises(ValueError, match="engine must be one of"):
        Topology(model="/m", engine="trt")
    with pytest.raises(ValueError, match="dp must be 1"):
        Topology(model="/m", engine="vllm", prefill=(PrefillSpec(dp=2),))
    with pytest.raises(ValueError, match="tp and dcp are for engine vllm"):
        Topology(model="/m", prefill=(PrefillSpec(tp=2),))
    # vLLM's parallel sizes travel to the node's flags and back into its config.
    t = Topology(model="/m", engine="vllm", prefill=(PrefillSpec(pcp=2, tp=2, dcp=2, pp=2),),
                 decode=(DecodeSpec(tp=2),))
    node_cli = pytest.importorskip("node_runtime.cli")
    (tmp_path / "config.json").write_text("{}")
    pre, dec = cluster_commands(t, URL, proxy_port=8000)[:2]
    node, _ = node_cli.parse("prefill", [str(tmp_path) if a == "/m" else a for a in pre.argv[3:]])
    assert (node.tp, node.dcp, node.engine.pcp, node.engine.pp, node.engine_backend) == (2, 2, 2, 2, "vllm")
    node, _ = node_cli.parse("decode", [str(tmp_path) if a == "/m" else a for a in dec.argv[3:]])
    assert (node.tp, node.dcp) == (2, 1)
    node, _ = node_cli.parse("decode", ["--model", str(tmp_path), "--node-id", "d0", "--engine", "vllm"])
    assert node.engine_backend == "vllm"
    with pytest.raises(SystemExit):  # the native engine has no TP
        node_cli.parse("decode", ["--model", str(tmp_path), "--node-id", "d0", "--tp", "2"])
    node, _ = node_cli.parse("decode", ["--model", str(tmp_path), "--node-id", "d0"])
    assert node.engine_backend == "native"


def test_mixed_engines_per_node(monkeypatch) -> None:
    """Native prefill nodes serve vLLM decode nodes; a vLLM prefill node needs a vLLM decode node."""
    monkeypatch.setenv("VLLM_VENV", "/venvs/v")
    t = Topology.from_dict({"model": "/m", "prefill": [{"pcp": 2}, {"engine": "vllm", "tp": 2}],
                            "decode": [{"engine": "vllm"}, {"dp": 2}]})
    p0, p1, d0, d1, _ = cluster_commands(t, URL, proxy_port=8000)
    assert p0.argv[0] == sys.executable and "--engine" not in p0.argv
    assert p1.argv[0] == "/venvs/v/bin/python" and p1.argv[p1.argv.index("--tp") + 1] == "2"
    assert d0.argv[0] == "/venvs/v/bin/python" and "--engine" in d0.argv
    assert d1.argv[0] == sys.executable and "--engine" not in d1.argv
    with pytest.raises(ValueError, match="only by vLLM decode nodes"):
        Topology(model="/m", prefill=(PrefillSpec(engine="vllm"),), decode=(DecodeSpec(),))
    with pytest.raises(ValueError, match="dp must be 1"):
        Topology(model="/m", decode=(DecodeSpec(engine="vllm", dp=2),))
    with pytest.raises(ValueError, match="engine must be one of"):
        PrefillSpec(engine="trt")


def test_gpus_of_a_node_in_yaml_become_its_flag(tmp_path) -> None:
    from pdctl.launcher import cluster_commands

    t = load_topology(write(tmp_path, "model: /m\nprefill: [{pcp: 2, gpus: [2, 3]}]\ndecode: [{gpus: '1'}]\n"))
    argv = {c.name: c.argv for c in cluster_commands(t, "redis://x", 8000)}
    assert argv["prefill-0"][argv["prefill-0"].index("--gpus") + 1] == "2,3"
    assert argv["decode-0"][argv["decode-0"].index("--gpus") + 1] == "1"
    with pytest.raises(ValueError, match="gpus must"):
        load_topology(write(tmp_path, "model: /m\nprefill: [{gpus: [a]}]\n"))


def test_vllm_node_device_range(monkeypatch) -> None:
    """``cuda:K`` gives a vLLM node's workers GPUs K.. of those visible."""
    from vllm_backend.engine import place_devices

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    place_devices("cuda:2", 2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    place_devices("cuda:1", 2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,6"
    with pytest.raises(ValueError, match="2 are visible"):
        place_devices("cuda:1", 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    place_devices("cpu", 4)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    place_devices("cuda", 2, gpus=[3, 1])  # --gpus picks among the visible ones
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7,5"


def test_the_proxy_refuses_an_open_admin_api_off_loopback(monkeypatch, capsys) -> None:
    """/admin without a key is allowed on loopback only, unless --insecure-admin says so."""
    proxy_cli = pytest.importorskip("proxy.cli")
    monkeypatch.delenv("PDCLUSTER_ADMIN_KEY", raising=False)
    base = ["--model", "/m"]
    assert proxy_cli.parse_args(base)[0].host == "127.0.0.1"  # the default: no key needed
    with pytest.raises(SystemExit):
        proxy_cli.parse_args([*base, "--host", "0.0.0.0"])
    assert "--admin-key" in capsys.readouterr().err
    assert proxy_cli.parse_args([*base, "--host", "0.0.0.0", "--insecure-admin"])[0].insecure_admin
    assert proxy_cli.parse_args([*base, "--host", "0.0.0.0", "--admin-key", "k"])[0].admin_key == "k"
    monkeypatch.setenv("PDCLUSTER_ADMIN_KEY", "env-key")
    assert proxy_cli.parse_args([*base, "--host", "0.0.0.0"])[0].admin_key == "env-key"
