"""Flags generated from the config dataclasses (cluster.flags), and the topology keys that follow them."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import pickle
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cluster import flags
from cluster.config import NODE_NOT_FLAGS, NODE_RENAMES, NODE_ROLE_ONLY, NodeConfig, RegistryConfig
from pdctl.launcher import cluster_commands, prefill_command
from pdctl.topology import DecodeSpec, PrefillSpec, Topology, load_topology

ROOT = Path(__file__).resolve().parents[2]
URL = "redis://127.0.0.1:7001/0"


@dataclass(frozen=True)
class Knobs:
    path: str = field(metadata={"help": "where", "metavar": "DIR"})
    count: int = field(default=3, metadata={"help": "how many"})
    ratio: float = 0.5
    name: str | None = None
    mode: str = field(default="a", metadata={"choices": ("a", "b")})
    fast: bool = False
    hidden: int = 9


def parser_of(cls: type, **kwargs) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(exit_on_error=False)
    flags.add_flags(ap, flags.knobs(cls), **kwargs)
    return ap


def test_fields_become_flags_and_round_trip() -> None:
    ap = parser_of(Knobs, exclude={"hidden"}, renames={"ratio": "share"})
    help_text = ap.format_help()
    for flag in ("--path DIR", "--count N", "--share X", "--name NAME", "--mode {a,b}", "--fast", "--no-fast"):
        assert flag in help_text, flag
    assert "how many (default: 3)" in help_text and "--hidden" not in help_text
    assert flags.build(Knobs, ap.parse_args(["--path", "p"]), exclude={"hidden"}, renames={"ratio": "share"}) \
        == Knobs(path="p")
    given = ["--path", "p", "--count", "4", "--share", "0.25", "--name", "n", "--mode", "b", "--fast"]
    built = flags.build(Knobs, ap.parse_args(given), exclude={"hidden"}, renames={"ratio": "share"}, hidden=1)
    assert built == Knobs(path="p", count=4, ratio=0.25, name="n", mode="b", fast=True, hidden=1)
    # and back: values (by key) -> flags -> the same dataclass
    values = {flags.key(f.name, {"ratio": "share"}): getattr(built, f.name) for f in dataclasses.fields(built)
              if f.name != "hidden"}
    again = flags.build(Knobs, ap.parse_args(flags.to_argv(values)), renames={"ratio": "share"})
    assert again == dataclasses.replace(built, hidden=9)
    with pytest.raises(SystemExit):  # --path is required: the field has no default
        parser_of(Knobs).parse_args([])
    with pytest.raises(argparse.ArgumentError):
        ap.parse_args(["--path", "p", "--mode", "c"])


def test_a_field_added_to_the_dataclass_is_a_flag_at_once() -> None:
    more = dataclasses.make_dataclass("More", [("retries", int, field(default=2, metadata={"help": "tries"}))],
                                      bases=(Knobs,), frozen=True)
    ap = parser_of(more)
    assert "--retries N" in ap.format_help() and "tries (default: 2)" in ap.format_help()
    assert flags.build(more, ap.parse_args(["--path", "p", "--retries", "5"])).retries == 5
    assert flags.to_argv({"retries": 5, "name": None, "fast": False, "ratio": 2.0}) == \
        ["--retries", "5", "--no-fast", "--ratio", "2"]


def test_a_nested_config_must_be_excluded() -> None:
    @dataclass
    class Outer:
        inner: Knobs
        n: int = 1

    with pytest.raises(TypeError, match="'inner' is not a scalar"):
        parser_of(Outer)
    assert flags.build(Outer, parser_of(Outer, exclude={"inner"}).parse_args([]), inner=Knobs("p")).n == 1


def test_source_knobs_read_without_importing(tmp_path, monkeypatch) -> None:
    (tmp_path / "knobs_src.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass, field
        import not_importable_here  # reading the fields must not import the module

        @dataclass
        class C:
            a: int
            b: "float | None" = None
            c: str = field(default="x", metadata={"help": "the c", "choices": ("x", *not_importable_here.MORE)})
            d: bool = field(default=True)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    got = flags.source_knobs("knobs_src", "C")
    assert got == [flags.Knob("a", int), flags.Knob("b", float, True, None),
                   flags.Knob("c", str, False, "x", "the c"), flags.Knob("d", bool, False, True)]
    assert "knobs_src" not in sys.modules


def test_engine_config_read_from_source_equals_the_class() -> None:
    """pdctl reads EngineConfig's fields from its source; they are the class's (choices aside)."""
    from engine.engine_config import EngineConfig

    def strip(ks: list[flags.Knob]) -> list[flags.Knob]:
        return [dataclasses.replace(k, choices=None) for k in ks]

    assert strip(flags.source_knobs("engine.engine_config", "EngineConfig")) == strip(flags.knobs(EngineConfig))


# --- the node processes ---

OLD_FLAGS = {"--model", "--served-model-name", "--node-id", "--host", "--port", "--advertise-host", "--registry-url",
             "--cluster", "--heartbeat-s", "--ttl-s", "--dp", "--tp", "--dcp", "--dtype", "--device", "--max-model-len",
             "--max-num-batched-tokens", "--max-num-seqs", "--block-size", "--num-kv-blocks",
             "--gpu-memory-utilization", "--load-format", "--seed", "--engine", "--grace-s"}
ROLE_FLAGS = {"prefill": {"--pcp", "--pp", "--kv-layout", "--kv-interleave", "--lease-s"},
              "decode": {"--transfer-timeout-s"}}


def node_flags(role: str, node_cli) -> set[str]:
    return {s for a in node_cli.parser(role)._actions for s in a.option_strings if s.startswith("--")}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_node_flags_are_the_dataclasses_fields(role) -> None:
    node_cli = pytest.importorskip("node_runtime.cli")
    from engine.engine_config import EngineConfig

    have = node_flags(role, node_cli)
    other = "decode" if role == "prefill" else "prefill"
    assert OLD_FLAGS | ROLE_FLAGS[role] <= have  # every historic flag, with its role's
    assert not have & ROLE_FLAGS[other]
    assert {"--cpu-kv-cache-gb", "--cpu-threads", "--rank-timeout-s"} <= have  # EngineConfig fields, no edit
    fields = [f for cls in (EngineConfig, NodeConfig, RegistryConfig) for f in dataclasses.fields(cls)]
    expected = {prefix + flags.key(f.name, NODE_RENAMES).replace("_", "-")
                for f in fields if f.name not in NODE_NOT_FLAGS and f.name not in NODE_ROLE_ONLY[other]
                for prefix in (("--", "--no-") if f.type in (bool, "bool", "bool | None") else ("--",))}  # --x/--no-x
    assert have == expected | {"--help", "--served-model-name"}


def test_a_field_added_to_engine_config_is_a_node_flag(tmp_path, monkeypatch) -> None:
    node_cli = pytest.importorskip("node_runtime.cli")
    from engine.engine_config import EngineConfig

    more = dataclasses.make_dataclass("EngineConfig", [("new_knob", int, field(default=7))], bases=(EngineConfig,),
                                      frozen=True)
    monkeypatch.setattr(node_cli, "EngineConfig", more)
    (tmp_path / "config.json").write_text("{}")
    node, _ = node_cli.parse("decode", ["--model", str(tmp_path), "--node-id", "d0", "--new-knob", "3"])
    assert node.engine.new_knob == 3 and isinstance(node.engine, more)


def test_node_flags_keep_their_meaning(tmp_path) -> None:
    node_cli = pytest.importorskip("node_runtime.cli")
    (tmp_path / "config.json").write_text("{}")
    node, served = node_cli.parse("prefill", [
        "--model", str(tmp_path), "--node-id", "p0", "--engine", "vllm", "--registry-url", URL, "--cluster", "c",
        "--heartbeat-s", "0.5", "--ttl-s", "2", "--pcp", "2", "--kv-layout", "replicated", "--lease-s", "5",
        "--max-num-seqs", "8", "--cpu-threads", "2", "--served-model-name", "m"])
    assert (node.role, node.node_id, node.engine_backend, served) == ("prefill", "p0", "vllm", "m")
    assert node.registry == RegistryConfig(url=URL, cluster="c", ttl_s=2.0, heartbeat_s=0.5)
    e = node.engine
    assert (e.model, e.pcp, e.kv_layout, e.max_num_seqs, e.cpu_threads, node.lease_s) == \
        (str(tmp_path), 2, "replicated", 8, 2, 5.0)
    with pytest.raises(SystemExit):
        node_cli.parse("decode", ["--model", str(tmp_path), "--node-id", "d0", "--lease-s", "5"])


# --- topology keys ---

def test_unknown_topology_key_is_refused_with_the_valid_ones(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"unknown keys \['max_num_seq'\]") as e:
        PrefillSpec(max_num_seq=8)
    assert "max_num_seqs" in str(e.value) and "cpu_threads" in str(e.value) and "lease_s" in str(e.value)
    assert "transfer_timeout_s" not in str(e.value)  # a decode node's
    with pytest.raises(ValueError, match=r"unknown keys \['lease_s'\] \(lease_s is a prefill node's\); a decode"):
        DecodeSpec(lease_s=3)
    for launcher_set in ("model", "node_id", "host", "registry_url", "dist_port", "tokenizer"):
        with pytest.raises(ValueError, match="unknown keys"):
            DecodeSpec(**{launcher_set: "x"})
    path = tmp_path / "t.yaml"
    path.write_text("model: m\ndecode: [{dp: 2, max_num_seq: 8}]\n")
    with pytest.raises(ValueError, match=r"topology decode\[0\]: unknown keys \['max_num_seq'\].*max_num_seqs"):
        load_topology(path)


def test_topology_keys_are_checked_by_type() -> None:
    with pytest.raises(ValueError, match="cpu_kv_cache_gb must be a number, got 'x'"):
        PrefillSpec(cpu_kv_cache_gb="x")
    with pytest.raises(ValueError, match="seed must be an integer, got 1.5"):
        DecodeSpec(seed=1.5)
    with pytest.raises(ValueError, match="cpu_threads must not be null"):
        DecodeSpec(cpu_threads=None)
    with pytest.raises(ValueError, match=r"load_format must be a string, got \[1\]"):
        DecodeSpec(load_format=[1])


def test_engine_overrides_reach_the_node(tmp_path) -> None:
    """Any EngineConfig field is a topology key; the launcher passes it as the flag of its name."""
    node_cli = pytest.importorskip("node_runtime.cli")
    (tmp_path / "config.json").write_text("{}")
    t = Topology(model=str(tmp_path), prefill=(PrefillSpec(cpu_threads=2, rank_timeout_s=30, block_size=32,
                                                           max_model_len=None, grace_s=3, dtype="auto"),))
    spec = t.prefill[0]
    assert dict(spec.engine_config) == {"device": "cpu", "cpu_threads": 2, "block_size": 32, "rank_timeout_s": 30}
    assert dict(spec.settings) == {"grace_s": 3}
    argv = prefill_command(t, 0, URL, python="py").argv
    assert "--max-model-len" not in argv and "--dtype" not in argv  # null and the node's default: left out
    node, _ = node_cli.parse("prefill", list(argv[3:]))
    e = node.engine
    assert (e.cpu_threads, e.rank_timeout_s, e.block_size, e.max_model_len, e.dtype, node.grace_s) == \
        (2, 30.0, 32, None, "auto", 3.0)


def test_specs_compare_by_what_the_node_runs() -> None:
    assert PrefillSpec(pcp=1, kv_layout="sharded", lease_s=30) == PrefillSpec()  # the node's defaults
    assert PrefillSpec(lease_s=5) == PrefillSpec(lease_s=5.0) != PrefillSpec()
    assert PrefillSpec(dtype="float32") == PrefillSpec() != PrefillSpec(dtype="auto")  # NODE_DEFAULTS
    assert PrefillSpec().value("dtype") == "float32" and PrefillSpec(dtype="auto").value("dtype") == "auto"
    assert PrefillSpec(engine="native") != PrefillSpec()  # a node's own engine vs the topology's
    assert PrefillSpec(pcp=2) != DecodeSpec() and len({PrefillSpec(), PrefillSpec(pp=1)}) == 1
    assert repr(PrefillSpec(pcp=2)) == "PrefillSpec(dtype='float32', device='cpu', max_model_len=2048, pcp=2)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        PrefillSpec().settings = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        PrefillSpec().engine_config["dp"] = 2  # type: ignore[index]


def test_topology_round_trips_through_its_yaml_form(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_VENV", "/venvs/v")
    t = Topology(model="/m", engine="vllm", prefill=(PrefillSpec(tp=2, cpu_threads=2), PrefillSpec(engine="native")),
                 decode=(DecodeSpec(max_num_seqs=8, transfer_timeout_s=3, dtype="auto", max_model_len=None),))
    assert Topology.from_dict(t.to_dict()) == t
    assert t.to_dict()["decode"] == [{"dtype": "auto", "device": "cpu", "max_model_len": None, "max_num_seqs": 8,
                                      "transfer_timeout_s": 3}]
    assert copy.deepcopy(t) == t and pickle.loads(pickle.dumps(t)) == t
    assert [s.argv[0] for s in cluster_commands(t, URL, proxy_port=8000)[:3]] == \
        ["/venvs/v/bin/python", sys.executable, "/venvs/v/bin/python"]


def test_pdctl_and_the_proxy_do_not_load_torch() -> None:
    code = ("import sys, pdctl.cli, pdctl.launcher, proxy.__main__, proxy.cli as p; "
            "from pdctl.topology import PrefillSpec; "
            "PrefillSpec(cpu_threads=2); p.parse_args(['--model', 'm']); assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
