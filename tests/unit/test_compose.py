"""docker-compose.yml and the Dockerfile, checked offline (no docker engine on the dev machine).

Debian's ``docker-compose`` (v1.29, installed by scripts/setup.sh) validates the file for each
profile. The structure is read with PyYAML after compose-style ``${VAR:-default}`` interpolation,
and every service's command is checked against the processes' command-line contract (``FLAGS``)
and, once a process's ``__main__`` exists, against its real ``--help``. The healthcheck commands
are run against a stub gRPC health server (grpc.health.v1) and a stub HTTP server.
"""

from __future__ import annotations

import http.server
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"

# The command-line contract of each process: every flag the compose file may pass; REQUIRED must be.
FLAGS = {
    "prefill_node": {"--model", "--node-id", "--host", "--port", "--metrics-port", "--advertise-host",
                     "--registry-url", "--cluster", "--dp", "--pcp", "--pp", "--kv-layout", "--dtype", "--device",
                     "--max-model-len", "--max-num-batched-tokens", "--num-kv-blocks", "--lease-s"},
    "decode_node": {"--model", "--node-id", "--host", "--port", "--metrics-port", "--advertise-host",
                    "--registry-url", "--cluster", "--dp", "--dtype", "--device", "--max-model-len", "--max-num-seqs",
                    "--num-kv-blocks", "--transfer-timeout-s"},
    "proxy": {"--model", "--served-model-name", "--host", "--port", "--registry-url", "--cluster", "--api-key",
              "--admin-key", "--insecure-admin", "--workers"},
}
OPTIONAL = {"--num-kv-blocks", "--api-key", "--admin-key", "--insecure-admin"}
SWITCHES = {"--insecure-admin"}  # flags without a value
APP_SERVICES = {  # service -> (module, profile)
    "prefill": ("prefill_node", "cpu"), "decode": ("decode_node", "cpu"), "proxy": ("proxy", "cpu"),
    "prefill-gpu": ("prefill_node", "gpu"), "decode-gpu": ("decode_node", "gpu"), "proxy-gpu": ("proxy", "gpu"),
}
_VAR = re.compile(r"\$(?:\$|\{(\w+)(?:(:?-)([^}]*))?\}|(\w+))")


def _interpolate(value, env: dict[str, str]):
    """Compose's variable substitution: ``$$`` is a literal ``$``; ``${V:-d}``, ``${V-d}``, ``${V}``, ``$V``."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group(1) or m.group(4), m.group(2), m.group(3)
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return _VAR.sub(sub, value)


def _load(env: dict[str, str] | None = None) -> dict:
    return _interpolate(yaml.safe_load(COMPOSE.read_text()), env or {})


@pytest.fixture(scope="module")
def services() -> dict:
    return _load()["services"]


def _argv(service: dict, env: dict[str, str] | None = None, tmp: Path | None = None) -> list[str]:
    """The process's argv after ``python``; a ``sh -c`` command is run by sh with a stub ``python``."""
    cmd = service["command"]
    if cmd[:2] != ["sh", "-c"]:
        assert cmd[0] == "python", cmd
        return cmd[1:]
    assert tmp is not None
    stub = tmp / "python"
    stub.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    stub.chmod(0o755)
    out = subprocess.run(cmd, env={"PATH": f"{tmp}:/usr/bin:/bin", **(env or {})}, capture_output=True, text=True,
                         check=True, timeout=30)
    return out.stdout.splitlines()


def _flags(argv: list[str]) -> tuple[str, dict[str, str]]:
    """``-m MODULE --flag=value | --flag value ...`` -> (module, {flag: value})."""
    assert argv[0] == "-m", argv
    module, args, flags = argv[1], argv[2:], {}
    i = 0
    while i < len(args):
        assert args[i].startswith("--"), f"{module}: unexpected argument {args[i]!r} in {args}"
        if "=" in args[i]:
            flag, value = args[i].split("=", 1)
            i += 1
        elif args[i] in SWITCHES:
            flag, value = args[i], "true"
            i += 1
        else:
            flag, value = args[i], args[i + 1]
            i += 2
        assert flag not in flags, f"{module}: {flag} given twice"
        flags[flag] = value
    return module, flags


def _docker_compose() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        message = "docker-compose is not installed (scripts/setup.sh installs Debian's docker-compose)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return exe


def _compose_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDCLUSTER_", "COMPOSE_"))}
    return {**env, **extra}


# ids are not bare "gpu": tests/conftest.py skips items with a "gpu" keyword when CUDA is absent.
@pytest.mark.parametrize("profile", [None, "cpu", "gpu", "monitoring"],
                         ids=["no-profile", "profile-cpu", "profile-gpu", "profile-monitoring"])
def test_docker_compose_config_is_valid(profile):
    exe = _docker_compose()
    profile_args = ["--profile", profile] if profile else []
    out = subprocess.run([exe, "-f", str(COMPOSE), *profile_args, "config", "-q"], cwd=ROOT, env=_compose_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_docker_compose_resolves_knobs_like_this_test():
    """docker-compose's own interpolation agrees with ``_interpolate`` on overridden knobs."""
    exe = _docker_compose()
    knobs = {"PDCLUSTER_PROXY_PORT": "9000", "PDCLUSTER_PREFILL_PCP": "4", "PDCLUSTER_MODEL_DIR": "/data/ds"}
    out = subprocess.run([exe, "-f", str(COMPOSE), "config"], cwd=ROOT, env=_compose_env(**knobs),
                         capture_output=True, text=True, timeout=120, check=True)
    resolved = yaml.safe_load(out.stdout)["services"]
    ours = _load(knobs)["services"]
    assert "--pcp=4" in resolved["prefill"]["command"]
    assert resolved["prefill"]["command"] == ours["prefill"]["command"]
    assert "127.0.0.1:9000:8000" in str(resolved["proxy"]["ports"])  # v1.29 prints "127.0.0.1:9000:8000/tcp"
    assert any(v.startswith("/data/ds:/models/deepseek") for v in resolved["decode-gpu"]["volumes"])


def test_services_and_profiles(services):
    assert {"redis", "model", "prefill", "decode", "proxy"} <= set(services)
    assert "profiles" not in services["redis"]  # the registry serves both profiles
    for name, (_, profile) in APP_SERVICES.items():
        assert services[name]["profiles"] == [profile], name
    assert services["model"]["profiles"] == ["cpu"]


def test_redis(services):
    redis = services["redis"]
    assert redis["image"].startswith("redis:7")
    assert redis["command"] == ["redis-server", "--save", "", "--appendonly", "no"]
    assert "ports" not in redis
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_model_service_writes_the_tiny_model_once(services):
    model = services["model"]
    script = model["command"][2]
    assert model["command"][:2] == ["sh", "-c"]
    assert script.startswith("test -d /models/tiny ||")
    assert "pdctl make-model /models/.tiny.tmp --seed 0" in script and "mv /models/.tiny.tmp /models/tiny" in script
    assert model["volumes"] == ["models:/models"]
    assert model["restart"] == "no"
    assert "models" in _load()["volumes"]


@pytest.mark.parametrize("name", sorted(APP_SERVICES))
def test_command_matches_the_cli_contract(services, name, tmp_path):
    service = services[name]
    module, flags = _flags(_argv(service, tmp=tmp_path))
    assert module == APP_SERVICES[name][0]
    assert set(flags) <= FLAGS[module], f"{name}: unknown flags {set(flags) - FLAGS[module]}"
    assert FLAGS[module] - OPTIONAL <= set(flags), f"{name}: missing {FLAGS[module] - OPTIONAL - set(flags)}"
    assert flags["--host"] == "0.0.0.0"
    assert flags["--registry-url"] == "redis://redis:6379/0"
    assert flags["--cluster"] == "pdcluster"
    # the proxy serves nodes that publish its served model name: a model directory's name by default
    assert flags["--model"] == ("/models/tiny" if APP_SERVICES[name][1] == "cpu" else "/models/deepseek")
    if module == "proxy":
        assert flags["--served-model-name"] == Path(flags["--model"]).name
    for flag in ("--port", "--workers", "--dp", "--pcp", "--pp", "--max-model-len", "--max-num-batched-tokens",
                 "--max-num-seqs", "--lease-s", "--transfer-timeout-s"):
        if flag in flags:
            assert int(flags[flag]) > 0, (name, flag)
    if module != "proxy":
        # the compose service name resolves in the network; it is the KV transport's host too
        # (node_runtime.server.transfer_host), which no environment variable overrides
        assert flags["--advertise-host"] == name
        # knobs are flags; the one variable is the cluster token (a secret: not on the command line)
        assert {k for k in service.get("environment", {}) if k.startswith("PDCLUSTER_")} == {"PDCLUSTER_CLUSTER_TOKEN"}
        assert f"127.0.0.1:{flags['--port']}" in service["healthcheck"]["test"][-1]
        gpu = APP_SERVICES[name][1] == "gpu"
        assert (flags["--dtype"], flags["--device"]) == (("bfloat16", "cuda") if gpu else ("float32", "cpu"))


@pytest.mark.parametrize("module", sorted(FLAGS))
def test_flags_exist_in_the_real_cli(services, module, tmp_path):
    """Once ``python -m MODULE`` exists, every flag the compose file passes appears in its --help."""
    if importlib.util.find_spec(module) is None or importlib.util.find_spec(f"{module}.__main__") is None:
        pytest.skip(f"python -m {module} does not exist yet: flags checked against FLAGS only")
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    known = set(re.findall(r"--[a-z][a-z0-9-]*", out.stdout))
    used = set()
    for name, (mod, _) in APP_SERVICES.items():
        if mod == module:
            used |= set(_flags(_argv(services[name], env={"PDCLUSTER_API_KEY": "k", "PDCLUSTER_ADMIN_KEY": "a"},
                                     tmp=tmp_path))[1])
    assert used - known == set(), f"python -m {module} has no {sorted(used - known)}"


def test_cpu_profile_topology(services):
    _, prefill = _flags(services["prefill"]["command"][1:])
    _, decode = _flags(services["decode"]["command"][1:])
    assert (prefill["--pcp"], prefill["--kv-layout"], decode["--dp"]) == ("2", "sharded", "2")
    for name in ("prefill", "decode", "proxy"):
        assert services[name]["depends_on"] == {"redis": {"condition": "service_healthy"},
                                                "model": {"condition": "service_completed_successfully"}}
        assert "models:/models:ro" in services[name]["volumes"]
        assert "deploy" not in services[name]


def test_gpu_profile_reserves_nvidia_gpus_per_node():
    knobs = {"PDCLUSTER_MODEL_DIR": "/data/ds-v2-lite", "PDCLUSTER_SERVED_MODEL_NAME": "ds"}
    services = _load(knobs)["services"]
    visible = {}
    for name in ("prefill-gpu", "decode-gpu"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices and all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
        visible[name] = services[name]["environment"]["CUDA_VISIBLE_DEVICES"].split(",")
        assert "/data/ds-v2-lite:/models/ds:ro" in services[name]["volumes"]
        assert "--model=/models/ds" in services[name]["command"]
    _, prefill = _flags(services["prefill-gpu"]["command"][1:])
    _, decode = _flags(services["decode-gpu"]["command"][1:])
    # one GPU per rank: DP x PCP x PP on the prefill node, DP on the decode node, none shared
    assert len(visible["prefill-gpu"]) == int(prefill["--dp"]) * int(prefill["--pcp"]) * int(prefill["--pp"]) == 2
    assert len(visible["decode-gpu"]) == int(decode["--dp"])
    assert not set(visible["prefill-gpu"]) & set(visible["decode-gpu"])
    assert "deploy" not in services["proxy-gpu"]


@pytest.mark.parametrize("name", ["proxy", "proxy-gpu"])
def test_proxy_port_and_keys(name, tmp_path):
    assert _load()["services"][name]["ports"] == ["127.0.0.1:8000:8000"]
    knobs = {"PDCLUSTER_PROXY_BIND": "0.0.0.0", "PDCLUSTER_PROXY_PORT": "9000"}
    assert _load(knobs)["services"][name]["ports"] == ["0.0.0.0:9000:8000"]
    service = _load()["services"][name]
    assert set(service["environment"]) == {"PDCLUSTER_API_KEY", "PDCLUSTER_ADMIN_KEY", "PDCLUSTER_PROXY_BIND",
                                           "PDCLUSTER_CLUSTER_TOKEN"}
    _, flags = _flags(_argv(service, tmp=tmp_path))  # unset keys add no flag
    assert "--api-key" not in flags and "--admin-key" not in flags
    # No admin key: /admin is open only where the port is published on the host's loopback.
    _, flags = _flags(_argv(service, env={"PDCLUSTER_PROXY_BIND": "127.0.0.1"}, tmp=tmp_path))
    assert "--insecure-admin" in flags
    _, flags = _flags(_argv(service, env={"PDCLUSTER_PROXY_BIND": "0.0.0.0"}, tmp=tmp_path))
    assert "--insecure-admin" not in flags  # then the proxy refuses to start without a key
    _, flags = _flags(_argv(service, env={"PDCLUSTER_PROXY_BIND": "127.0.0.1", "PDCLUSTER_ADMIN_KEY": "a"},
                            tmp=tmp_path))
    assert "--insecure-admin" not in flags and flags["--admin-key"] == "a"
    keys = {"PDCLUSTER_API_KEY": "s3cret key$1", "PDCLUSTER_ADMIN_KEY": "adm'in"}
    _, flags = _flags(_argv(service, env=keys, tmp=tmp_path))
    assert (flags["--api-key"], flags["--admin-key"]) == ("s3cret key$1", "adm'in")


def test_only_the_proxy_is_published_and_long_runners_restart(services):
    published = {n for n, s in services.items() if "ports" in s}
    assert published == {"proxy", "proxy-gpu", "prometheus", "grafana"}
    for name in ("prometheus", "grafana"):  # the monitoring profile's: on the host's loopback only
        assert all(str(p).startswith("127.0.0.1:") for p in services[name]["ports"]), name
    for name in APP_SERVICES:
        assert services[name]["restart"] == "unless-stopped"
        assert "healthcheck" in services[name]
    assert services["redis"]["restart"] == "unless-stopped"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_node_healthcheck_asks_grpc_health(services, name):
    grpc = pytest.importorskip("grpc")
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    test = services[name]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    servicer = health.HealthServicer()
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{_free_port()}")
    server.start()
    try:
        code = re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{port}", test[3])
        # SERVING: registered (draining too); NOT_SERVING: not registered yet, or stopping
        for status, healthy in ((health_pb2.HealthCheckResponse.SERVING, True),
                                (health_pb2.HealthCheckResponse.NOT_SERVING, False)):
            servicer.set("", status)
            rc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=60).returncode
            assert (rc == 0) == healthy, (status, rc)
    finally:
        server.stop(0)
    code = re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{_free_port()}", test[3])  # nothing listening
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=60).returncode != 0


def test_proxy_healthcheck_needs_a_200(services):
    test = services["proxy"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"] and "/health" in test[3]
    state = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(state["code"] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = test[3].replace("127.0.0.1:8000", f"127.0.0.1:{server.server_port}")
        for status, healthy in ((200, True), (503, False)):
            state["code"] = status
            rc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode
            assert (rc == 0) == healthy, (status, rc)
    finally:
        server.shutdown()
        server.server_close()


def test_dockerfile_and_build_args():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    text = (ROOT / "Dockerfile").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert "libibverbs1" in text
    assert re.search(r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", text, re.M)
    default_extra = re.search(r"^ARG TRANSFER_EXTRA=(\S*)$", text, re.M).group(1)
    assert default_extra == "transfer-cpu" and default_extra in extras
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in ("root", "0")
    # dependencies are installed before the source is copied
    assert text.index("COPY pyproject.toml") < text.index("pip install -r") < text.index("COPY . .")
    for service in _load()["services"].values():
        extra = service.get("build", {}).get("args", {}).get("TRANSFER_EXTRA")
        assert extra is None or extra == "" or extra in extras
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    packages = ("engine", "kv_transfer", "prefill_node", "decode_node", "proxy", "cluster")
    assert not ignored & {"README.md", "pyproject.toml", *packages}


def test_every_service_gets_the_cluster_token(tmp_path):
    """gRPC between the services carries $PDCLUSTER_CLUSTER_TOKEN (cluster.auth): every node and proxy
    gets the same value from the environment (empty: not checked)."""
    services = _load({"PDCLUSTER_CLUSTER_TOKEN": "t0ken"})["services"]
    for name in APP_SERVICES:
        assert services[name]["environment"]["PDCLUSTER_CLUSTER_TOKEN"] == "t0ken", name


def test_the_monitoring_profile_scrapes_every_nodes_metrics_port_and_the_proxy(services):
    """Prometheus (profile monitoring) finds every node service of both profiles at the port its command
    gives --metrics-port, and the proxies at their HTTP port; Grafana loads the dashboard."""
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["monitoring"]
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j["dns_sd_configs"] for j in config["scrape_configs"]}
    (nodes,) = jobs["pdcluster-nodes"]
    (proxies,) = jobs["pdcluster-proxy"]
    node_services = {n for n, (module, _) in APP_SERVICES.items() if module.endswith("_node")}
    assert set(nodes["names"]) == node_services
    for name in node_services:
        assert f"--metrics-port={nodes['port']}" in services[name]["command"], name
    assert set(proxies["names"]) == {"proxy", "proxy-gpu"} and proxies["port"] == 8000
    mounts = [v.split(":")[0] for v in services["grafana"]["volumes"]]
    assert {"./deploy/grafana/pdcluster.json", "./deploy/grafana/provisioning"} <= set(mounts)
    for path in mounts:
        assert (ROOT / path).exists(), path
