"""A whole local cluster as subprocesses: ``pdctl up`` starts it, ``pdctl down`` stops it.

``up``: a local redis-server (unless the topology names an external registry), the prefill
nodes, the decode nodes and the proxy, each in its own process group with its output in
``<run_dir>/logs/<name>.log``; it returns once the proxy's ``/health`` answers 200 and every node
has registered. The state file ``<run_dir>/state.json`` (pids, ports, the proxy URL, log paths;
never the keys) is rewritten after every start, so ``down``, a separate process, can stop whatever
``up`` got to start, even if ``up`` itself died half-way. ``down`` stops the proxy, then the
nodes (which deregister), then Redis. Every process gets the cluster's gRPC token
(``cluster.auth``; ``<run_dir>/cluster-token``, readable by this user only) in its environment.

The command lines are built by pure functions (``cluster_commands``) so they can be checked
without starting anything. A node's engine overrides and settings become the flags they are named
after, so a knob added to ``EngineConfig`` or ``NodeConfig`` needs no edit here.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

import cluster
from cluster import envs
from cluster.config import DOWN_GRACE_S, NodeConfig
from cluster.flags import to_argv
from cluster.net import dial_host, free_port
from pdctl.process_group import ProcessRecord, is_running, record_of, spawn, stop_groups
from pdctl.redis_server import RedisServerError, start_redis
from pdctl.topology import NodeSpec, Topology

STATE_FILE = "state.json"
TOKEN_FILE = "cluster-token"  # the cluster's gRPC token (cluster.auth), for nodes started by hand
ADMIN_KEY_FILE = "admin-key"  # the proxy's admin key, for `pdctl status` and the others (this user only)
REDIS = "redis"
PROXY = "proxy"
_LOG_TAIL_LINES = 30
_POLL_S = 0.2  # how often `up` checks the processes and the proxy's /health

Progress = Callable[[str], None]


class LaunchError(RuntimeError):
    """The cluster could not be started or stopped; the message says why (with log tails)."""


class ClusterRunning(LaunchError):
    """A cluster started from this run directory still runs."""


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start: its name (node id, ``proxy``), command line and known port."""

    name: str
    argv: tuple[str, ...]
    port: int | None = None  # None: the process picks one and publishes it in the registry
    env: tuple[tuple[str, str], ...] = ()  # extra environment (secrets go here, not on the command line)


@dataclass(frozen=True)
class RunState:
    """What ``up`` started, as written to the state file."""

    cluster: str
    run_dir: str
    proxy_url: str
    registry_url: str
    admin_key: bool  # whether the proxy's /admin/* needs a key (the key itself is in ADMIN_KEY_FILE, not here)
    api_key: bool
    started_at: float
    processes: tuple[ProcessRecord, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "cluster": self.cluster,
            "run_dir": self.run_dir,
            "proxy_url": self.proxy_url,
            "registry_url": self.registry_url,
            "admin_key": self.admin_key,
            "api_key": self.api_key,
            "started_at": self.started_at,
            "processes": [p.to_dict() for p in self.processes],
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> RunState:
        return RunState(
            cluster=str(d["cluster"]), run_dir=str(d["run_dir"]), proxy_url=str(d["proxy_url"]),
            registry_url=str(d["registry_url"]), admin_key=bool(d["admin_key"]), api_key=bool(d["api_key"]),
            started_at=float(d["started_at"]), processes=tuple(ProcessRecord.from_dict(p) for p in d["processes"]),
        )


def default_run_dir(cluster_name: str) -> Path:
    return Path.home() / ".pdcluster" / cluster_name


# --- command lines (pure) ---

def prefill_command(topology: Topology, index: int, registry_url: str, python: str = sys.executable) -> ProcessSpec:
    return node_command(topology, "prefill", index, registry_url, python)


def decode_command(topology: Topology, index: int, registry_url: str, python: str = sys.executable) -> ProcessSpec:
    return node_command(topology, "decode", index, registry_url, python)


def node_command(topology: Topology, role: str, index: int, registry_url: str,
                 python: str = sys.executable) -> ProcessSpec:
    """A node's command line: what the launcher sets, then the spec's engine overrides and node
    settings as the flags they are named after (``cluster.flags.to_argv``)."""
    spec: NodeSpec = (topology.prefill if role == "prefill" else topology.decode)[index]
    node_id, port = f"{role}-{index}", spec.value("port")
    args = ["--model", topology.model]
    if topology.served_model_name is not None:
        # Nodes publish the served name and the proxy routes only to nodes of its own name.
        args += ["--served-model-name", topology.served_model_name]
    args += ["--node-id", node_id, "--host", topology.node_host, "--port", str(port),
             "--registry-url", registry_url, "--cluster", topology.cluster]
    if topology.registry.ttl_s is not None:
        args += ["--ttl-s", str(topology.registry.ttl_s)]
    settings = {k: v for k, v in spec.settings.items() if k not in ("port", "engine")}
    engine = topology.engine_of(spec)  # a node's own, else the topology's; left out when it is the node's default
    if engine != NodeConfig.engine_backend:
        settings["engine"] = engine
    argv = [python, "-m", f"{role}_node", *args, *to_argv(spec.engine_config), *to_argv(settings)]
    return ProcessSpec(node_id, tuple(argv), port or None)


def proxy_command(topology: Topology, registry_url: str, port: int, python: str = sys.executable) -> ProcessSpec:
    proxy = topology.proxy
    argv = [python, "-m", "proxy", "--model", topology.model]
    if topology.served_model_name is not None:
        argv += ["--served-model-name", topology.served_model_name]
    argv += ["--host", proxy.host, "--port", str(port), "--registry-url", registry_url, "--cluster", topology.cluster]
    if proxy.local_prefill_max_tokens:
        argv += ["--local-prefill-max-tokens", str(proxy.local_prefill_max_tokens)]
    if not proxy.local_prefill_fallback:
        argv += ["--no-local-prefill-fallback"]
    if proxy.workers != 1:
        argv += ["--workers", str(proxy.workers)]
    if not proxy.access_log:
        argv += ["--no-access-log"]
    if not proxy.pin_workers:
        argv += ["--no-pin-workers"]
    for flag, value in (("--token-timeout-s", proxy.token_timeout_s), ("--prefill-timeout-s", proxy.prefill_timeout_s)):
        if value is not None:
            argv += [flag, str(value)]
    env = []
    if proxy.api_key is not None:
        env.append((envs.API_KEY, proxy.api_key))
    if proxy.admin_key is not None:
        env.append((envs.ADMIN_KEY, proxy.admin_key))
    return ProcessSpec(PROXY, tuple(argv), port, tuple(env))


def cluster_commands(topology: Topology, registry_url: str, proxy_port: int,
                     python: str = sys.executable) -> list[ProcessSpec]:
    """Every process of the cluster but Redis, in start order: prefill nodes, decode nodes, proxy."""
    def py(spec: NodeSpec) -> str:  # vLLM nodes run in the vLLM venv's Python
        return topology.node_python(python, spec)

    return [
        *(prefill_command(topology, i, registry_url, py(s)) for i, s in enumerate(topology.prefill)),
        *(decode_command(topology, i, registry_url, py(s)) for i, s in enumerate(topology.decode)),
        proxy_command(topology, registry_url, proxy_port, python),
    ]


# --- state file ---

def read_state(run_dir: Path) -> RunState | None:
    path = run_dir / STATE_FILE
    try:
        return RunState.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LaunchError(f"state file {path} is unreadable ({e}); remove it if nothing runs") from None


def write_state(run_dir: Path, state: RunState) -> None:
    path = run_dir / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state.to_dict(), indent=2))
    os.replace(tmp, path)  # a reader never sees half a file


def remove_state(run_dir: Path) -> None:
    for name in (STATE_FILE, TOKEN_FILE, ADMIN_KEY_FILE):
        (run_dir / name).unlink(missing_ok=True)


def running_clusters(root: Path | None = None) -> list[RunState]:
    """The clusters `pdctl up` started under ``root`` (default ``~/.pdcluster``) that still run: how a
    bare `pdctl status` finds a cluster started with another run directory (the demo's)."""
    found = []
    for path in sorted((root or Path.home() / ".pdcluster").glob(f"*/{STATE_FILE}")):
        try:
            state = read_state(path.parent)
        except LaunchError:
            continue
        if state is not None and any(is_running(p) for p in state.processes):
            found.append(state)
    return found


def _ports_in_use(topology: Topology) -> list[str]:
    """The fixed ports the cluster would bind that something already holds (checked before anything starts)."""
    wanted = [(topology.proxy.host, topology.proxy.port, "the proxy (--proxy-port; the demo: PORT=...)")]
    if topology.registry.url is None and topology.registry.port:
        wanted.append(("127.0.0.1", topology.registry.port, "the local redis-server (--redis-port)"))
    for role, specs in (("prefill", topology.prefill), ("decode", topology.decode)):
        wanted += [(topology.node_host, s.value("port"), f"{role}-{i} (its port key)") for i, s in enumerate(specs)]
    busy = []
    for host, port, what in wanted:
        if not port:
            continue  # 0: a free one is picked
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no conflict
            try:
                s.bind((host, port))
            except OSError:
                busy.append(f"port {port} on {host}, for {what}")
    return busy


# --- up / down ---

def up(topology: Topology, run_dir: Path, timeout_s: float = 300.0, progress: Progress | None = None,
       python: str = sys.executable) -> RunState:
    """Start the cluster and wait until the proxy is healthy; on failure stop what was started."""
    say = progress or (lambda _msg: None)
    deadline = time.monotonic() + timeout_s
    run_dir = run_dir.expanduser().resolve()
    model = Path(topology.model).expanduser().resolve()
    if not (model / "config.json").is_file():
        raise LaunchError(f"model directory {model} has no config.json (write a tiny one with: pdctl make-model DIR)")
    topology = replace(topology, model=str(model))  # the children must not depend on our cwd
    _refuse_if_running(run_dir)
    busy = _ports_in_use(topology)
    if busy:
        raise LaunchError("in use, so nothing was started: " + "; ".join(busy) + ". Pick free ports")
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("*.log"):
        old.unlink()  # a tail shown on failure must come from this run
    proxy_port = topology.proxy.port or free_port(dial_host(topology.proxy.host))
    state = RunState(cluster=topology.cluster, run_dir=str(run_dir),
                     proxy_url=f"http://{dial_host(topology.proxy.host)}:{proxy_port}",
                     registry_url=topology.registry.url or "", admin_key=topology.proxy.admin_key is not None,
                     api_key=topology.proxy.api_key is not None, started_at=time.time())
    started: list[ProcessRecord] = []
    try:
        if topology.registry.url is None:
            say("starting redis-server")
            try:
                server = start_redis(topology.registry.port, data_dir=run_dir / "redis", log_path=logs / "redis.log")
            except RedisServerError as e:
                raise LaunchError(str(e)) from None
            started.append(record_of(REDIS, server.pid, server.log_path, server.port))
            state = replace(state, registry_url=server.url, processes=tuple(started))
            write_state(run_dir, state)
        children: dict[str, subprocess.Popen[bytes]] = {}
        env = {**_child_env(), envs.CLUSTER_TOKEN: cluster_token(run_dir)}
        if topology.proxy.admin_key is not None:  # so that pdctl's admin commands work right after up
            _private_file(run_dir / ADMIN_KEY_FILE, topology.proxy.admin_key)
        for spec in cluster_commands(topology, state.registry_url, proxy_port, python):
            say(f"starting {spec.name}")
            proc, record = spawn(spec.name, spec.argv, logs / f"{spec.name}.log", {**env, **dict(spec.env)},
                                 spec.port)
            children[spec.name] = proc
            started.append(record)
            state = replace(state, processes=tuple(started))
            write_state(run_dir, state)
        _wait_until_healthy(topology, state, children, deadline, say)
        return state
    except BaseException:  # a failure, Ctrl-C included: leave nothing running behind
        if not _stop(started, grace_s=10.0, say=say):
            remove_state(run_dir)  # else kept, so that `pdctl down` can try again
        raise


def down(run_dir: Path, grace_s: float = DOWN_GRACE_S, progress: Progress | None = None) -> RunState | None:
    """Stop what ``up`` started from ``run_dir``; None when there is nothing (idempotent)."""
    say = progress or (lambda _msg: None)
    run_dir = run_dir.expanduser().resolve()
    state = read_state(run_dir)
    if state is None:
        return None
    survivors = _stop(list(state.processes), grace_s, say)
    if survivors:
        raise LaunchError(f"could not stop {', '.join(survivors)}; state kept in {run_dir / STATE_FILE}")
    remove_state(run_dir)
    return state


def _stop(records: Sequence[ProcessRecord], grace_s: float, say: Progress | None = None) -> list[str]:
    # The proxy first (it finishes client requests, which need the nodes), then the nodes (they
    # deregister, which needs Redis), then Redis.
    phases = [[r for r in records if r.name == PROXY],
              [r for r in records if r.name not in (PROXY, REDIS)],
              [r for r in records if r.name == REDIS]]
    survivors = []
    for phase in phases:
        if phase:
            if say is not None:
                say(f"stopping {', '.join(r.name for r in phase)}")
            survivors += stop_groups(phase, grace_s)
    return survivors


def _refuse_if_running(run_dir: Path) -> None:
    state = read_state(run_dir)
    if state is None:
        return
    running = [p.name for p in state.processes if is_running(p)]
    if running:
        raise ClusterRunning(f"a cluster started from {run_dir} is running ({', '.join(running)}; proxy "
                             f"{state.proxy_url}); stop it first: pdctl down --run-dir {run_dir}")
    remove_state(run_dir)  # left behind by processes that are all gone


def cluster_token(run_dir: Path) -> str:
    """The token every process of the cluster gets (``cluster.auth``): ``$PDCLUSTER_CLUSTER_TOKEN`` when
    set, else a new random one, written to ``RUN_DIR/cluster-token`` (readable by this user only) for
    nodes started by hand to join with."""
    token = envs.cluster_token() or secrets.token_urlsafe(32)
    _private_file(run_dir / TOKEN_FILE, token)
    return token


def admin_key(run_dir: Path) -> str | None:
    """The admin key of the cluster `pdctl up` started from ``run_dir`` (None: it has none, or it is gone)."""
    try:
        return (run_dir / ADMIN_KEY_FILE).read_text().strip() or None
    except OSError:
        return None


def _private_file(path: Path, secret: str) -> None:
    """``secret`` in ``path``, readable by this user only (made so before anything is written)."""
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(secret + "\n")


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # logs show progress as it happens, and survive a crash
    # `python -m prefill_node` must import this source tree from any working directory.
    root = str(Path(cluster.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _wait_until_healthy(topology: Topology, state: RunState, children: Mapping[str, subprocess.Popen[bytes]],
                        deadline: float, say: Progress) -> None:
    registered = _RegisteredCounter(topology, state.registry_url)
    t0 = time.monotonic()
    try:
        with httpx.Client(timeout=2.0) as http:
            while True:
                proxy = _proxy_health(http, state.proxy_url)
                for name, proc in children.items():  # after /health: healthy then must mean all alive
                    if proc.poll() is not None:
                        raise LaunchError(f"{name} exited with code {proc.returncode} before the cluster was "
                                          f"ready:\n{_log_section(state, [name])}")
                # The proxy is healthy with one node of each role; a user who asked for more wants
                # them all, so wait for every node to register too (unless the registry is unreadable
                # from here, where the proxy's word has to do).
                if proxy == "200" and (not registered.missing() or not registered.reachable):
                    return
                elapsed = time.monotonic() - t0
                if time.monotonic() > deadline:
                    missing = [PROXY, *registered.missing()]
                    raise LaunchError(f"the cluster was not ready in time ({registered.summary()}; proxy "
                                      f"/health: {proxy}):\n{_log_section(state, missing)}")
                say(f"waiting for the cluster ({elapsed:.0f} s): {registered.summary()}; proxy /health: {proxy}")
                time.sleep(_POLL_S)
    finally:
        registered.close()


def _proxy_health(http: httpx.Client, proxy_url: str) -> str:
    try:
        return str(http.get(f"{proxy_url}/health").status_code)
    except httpx.HTTPError:
        return "not answering"


class _RegisteredCounter:
    """Which nodes have registered so far: for readiness, progress lines and which logs to show."""

    def __init__(self, topology: Topology, registry_url: str) -> None:
        # Imported here: the registry pulls in the engine's config (torch), which only `up` needs.
        from cluster.config import RegistryConfig
        from cluster.registry import Registry, RegistryError

        self._error = RegistryError
        self._registry = Registry(RegistryConfig(url=registry_url, cluster=topology.cluster))
        self._expected = [f"prefill-{i}" for i in range(len(topology.prefill))] + \
                         [f"decode-{i}" for i in range(len(topology.decode))]
        self._healthy: set[str] = set()
        self.reachable = True

    def refresh(self) -> None:
        try:
            self._healthy = {n.info.node_id for n in self._registry.nodes() if n.healthy}
            self.reachable = True
        except self._error:
            self.reachable = False

    def missing(self) -> list[str]:
        self.refresh()
        return [n for n in self._expected if n not in self._healthy]

    def summary(self) -> str:
        self.refresh()
        counts = []
        for role in ("prefill", "decode"):
            expected = [n for n in self._expected if n.startswith(role)]
            counts.append(f"{role} {sum(n in self._healthy for n in expected)}/{len(expected)}")
        return ", ".join(counts) + " registered"

    def close(self) -> None:
        self._registry.close()


def _log_section(state: RunState, names: Sequence[str]) -> str:
    parts = []
    for record in state.processes:
        if record.name in names:
            parts.append(f"--- {record.name}: last lines of {record.log} ---\n{_tail(Path(record.log))}")
    return "\n".join(parts) if parts else "no logs"


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) or "(empty)"
    except OSError:
        return "(no log)"
