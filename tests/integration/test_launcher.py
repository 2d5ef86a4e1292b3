"""`pdctl up` / `down` with stand-in processes: process groups, the state file, stopping, failures.

The launcher runs ``<python> -m prefill_node|decode_node|proxy ...``; here ``<python>`` is a fake
that answers like those modules would (the proxy serves ``/health``, a node spawns a "rank" child
in its group), with faults chosen through environment variables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from pdctl import launcher
from pdctl.launcher import ClusterRunning, LaunchError
from pdctl.process_group import ProcessRecord, is_running, record_of, spawn, stop_groups
from pdctl.topology import DecodeSpec, PrefillSpec, ProxySpec, Topology

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
# Ignores SIGTERM, like a rank stuck in a collective.
STUBBORN = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)"]
# A node that starts a rank child in its own process group, then waits.
WITH_RANK = [sys.executable, "-c", "import subprocess, sys, time; "
             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"]

FAKE_PYTHON = f"""#!{sys.executable}
import http.server, os, subprocess, sys, threading, time
safety_net = threading.Timer(60, os._exit, (0,))  # should a test fail to stop us
safety_net.daemon = True
safety_net.start()
module, args = sys.argv[2], sys.argv[3:]
opts = dict(zip(args[0::2], args[1::2]))
print(module, "started with", " ".join(args), flush=True)
fault = os.environ.get("FAKE_FAULT", "")
if fault == "crash:" + module:
    print("boom: cannot load the model", flush=True)
    sys.exit(3)
if module == "proxy":
    status = 503 if fault == "unhealthy" or fault.startswith("crash:") else 200  # a node is missing
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer((opts["--host"], int(opts["--port"])), Health).serve_forever()
else:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a rank, same group
    if fault != "silent:" + opts["--node-id"]:
        # Register the way cluster.registry does (importing it would import torch: slow here).
        import json, redis
        r = redis.Redis.from_url(opts["--registry-url"], socket_timeout=2)
        role = module.split("_")[0]
        info = dict(node_id=opts["--node-id"], role=role, address="127.0.0.1:1", model="tiny", max_model_len=2048,
                    dp=1, pcp=1, pp=1, kv_layout="sharded", block_size=16, num_blocks=8, started_at=time.time())
        while True:
            record = dict(info=info, replicas=[], heartbeat_at=time.time(), ttl_s=5.0)
            r.set(opts["--cluster"] + ":node:" + info["node_id"], json.dumps(record), px=5000)
            r.sadd(opts["--cluster"] + ":nodes", info["node_id"])
            time.sleep(1)
    time.sleep(60)
"""


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# --- process groups ---

def test_stop_groups_ends_the_leader_and_its_group(tmp_path) -> None:
    _, node = spawn("node", WITH_RANK, tmp_path / "node.log")
    _, other = spawn("other", SLEEPER, tmp_path / "other.log")
    assert wait_until(lambda: is_running(node))
    assert stop_groups([node, other], grace_s=5.0) == []
    assert not is_running(node) and not is_running(other)


def test_stop_groups_kills_what_ignores_sigterm(tmp_path) -> None:
    proc, rec = spawn("stuck", STUBBORN, tmp_path / "stuck.log")
    assert wait_until(lambda: "ready" in (tmp_path / "stuck.log").read_text())
    t0 = time.monotonic()
    assert stop_groups([rec], grace_s=0.3, kill_wait_s=3.0) == []
    assert 0.3 <= time.monotonic() - t0 < 3.0  # waited out the grace period, then killed it
    assert not is_running(rec) and proc.poll() is not None


def test_a_reused_pid_is_left_alone(tmp_path) -> None:
    proc, rec = spawn("sleeper", SLEEPER, tmp_path / "s.log")
    try:
        forged = record_of("sleeper", proc.pid, tmp_path / "s.log")
        forged = type(forged)(**{**forged.to_dict(), "start_time": 1.0, "since_boot": 1.0})  # as if someone else's
        assert not is_running(forged)
        assert stop_groups([forged], grace_s=0.2) == []
        assert proc.poll() is None
    finally:
        stop_groups([rec], grace_s=2.0)


@pytest.mark.skipif(not Path("/proc/sys/kernel/random/boot_id").exists(), reason="no boot id (not Linux)")
def test_a_record_survives_a_wall_clock_step_but_not_a_reboot_or_another_start(tmp_path) -> None:
    """A VM resumed from a snapshot (or NTP) steps the wall clock, and with it every wall-clock start
    time psutil reports: the record must still match its process, or ``pdctl down`` stops nothing."""
    proc, rec = spawn("sleeper", SLEEPER, tmp_path / "s.log")
    try:
        assert rec.since_boot is not None and rec.boot_id
        stepped = ProcessRecord.from_dict({**rec.to_dict(), "start_time": rec.start_time + 3600.0})
        assert is_running(stepped)
        rebooted = ProcessRecord.from_dict({**rec.to_dict(), "boot_id": "another-boot"})
        assert not is_running(rebooted) and stop_groups([rebooted], grace_s=0.2) == [] and proc.poll() is None
        other = ProcessRecord.from_dict({**rec.to_dict(), "since_boot": rec.since_boot - 5.0})
        assert not is_running(other) and stop_groups([other], grace_s=0.2) == [] and proc.poll() is None
        assert stop_groups([stepped], grace_s=2.0) == []
        assert proc.wait(timeout=5) is not None
    finally:
        stop_groups([rec], grace_s=2.0)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="earlier versions recorded /proc's start time")
def test_a_record_of_an_earlier_version_still_matches_its_process(tmp_path) -> None:
    proc, rec = spawn("sleeper", SLEEPER, tmp_path / "s.log")
    try:
        ticks = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]  # what was recorded
        old = ProcessRecord.from_dict({**rec.to_dict(), "start_time": ticks, "since_boot": None, "boot_id": None})
        assert old.start_time == pytest.approx(rec.start_time, abs=1.0) and is_running(old)
        earlier = int(ticks) - 5 * os.sysconf("SC_CLK_TCK")  # 5 s before it: another process
        other = ProcessRecord.from_dict({**rec.to_dict(), "start_time": str(earlier), "since_boot": None,
                                         "boot_id": None})
        assert not is_running(other)
    finally:
        stop_groups([rec], grace_s=2.0)


# --- up / down ---

@pytest.fixture
def fake_python(tmp_path) -> str:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_PYTHON)
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def run_dir(tmp_path) -> Iterator[Path]:
    path = tmp_path / "run"
    yield path
    launcher.down(path, grace_s=5.0)  # whatever a failed test left running (idempotent)


@pytest.fixture
def model(tmp_path) -> Path:
    path = tmp_path / "tiny"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def small_topology(model: Path) -> Topology:
    return Topology(model=str(model), prefill=(PrefillSpec(pcp=2), PrefillSpec()), decode=(DecodeSpec(),),
                    proxy=ProxySpec(port=0, admin_key="k"))


def test_up_then_down(run_dir, fake_python, model) -> None:
    messages: list[str] = []
    state = launcher.up(small_topology(model), run_dir, timeout_s=30, progress=messages.append, python=fake_python)
    assert [p.name for p in state.processes] == ["redis", "prefill-0", "prefill-1", "decode-0", "proxy"]
    assert httpx.get(f"{state.proxy_url}/health", timeout=2).status_code == 200
    on_disk = json.loads((run_dir / "state.json").read_text())
    assert on_disk["proxy_url"] == state.proxy_url and on_disk["admin_key"] is True
    assert '"k"' not in (run_dir / "state.json").read_text()  # the key itself is not in the state file, but
    key = run_dir / launcher.ADMIN_KEY_FILE  # in one only this user can read, for pdctl's admin commands
    assert key.read_text() == "k\n" and key.stat().st_mode & 0o777 == 0o600 and launcher.admin_key(run_dir) == "k"
    assert all(is_running(p) for p in state.processes)
    log = (run_dir / "logs" / "prefill-0.log").read_text()
    assert f"--registry-url {state.registry_url} --cluster pdcluster" in log and "--pcp 2" in log
    assert "starting redis-server" in messages and "starting proxy" in messages
    with pytest.raises(ClusterRunning, match="pdctl down"):
        launcher.up(small_topology(model), run_dir, timeout_s=5, python=fake_python)
    stopped = launcher.down(run_dir, grace_s=5.0)
    assert stopped is not None and not (run_dir / "state.json").exists() and not key.exists()
    assert not any(is_running(p) for p in state.processes)  # rank children included
    assert launcher.down(run_dir) is None  # idempotent


def test_down_from_another_process(run_dir, fake_python, model) -> None:
    state = launcher.up(small_topology(model), run_dir, timeout_s=30, python=fake_python)
    down = subprocess.run([sys.executable, "-m", "pdctl.cli", "down", "--run-dir", str(run_dir), "--grace", "5"],
                          capture_output=True, text=True, timeout=60, cwd=Path(launcher.__file__).parent.parent)
    assert down.returncode == 0, down.stderr
    assert "stopped cluster pdcluster" in down.stdout
    assert not any(is_running(p) for p in state.processes)


def test_a_node_that_exits_early_fails_up_with_its_log(run_dir, fake_python, model, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_FAULT", "crash:decode_node")
    with pytest.raises(LaunchError, match="decode-0 exited with code 3") as err:
        launcher.up(small_topology(model), run_dir, timeout_s=30, python=fake_python)
    assert "boom: cannot load the model" in str(err.value)
    assert not (run_dir / "state.json").exists()
    assert (run_dir / "logs" / "prefill-0.log").exists()  # logs stay for the post-mortem


def test_up_times_out_and_stops_everything(run_dir, fake_python, model, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_FAULT", "unhealthy")
    started = []
    monkeypatch.setattr(launcher, "write_state", lambda d, s: started.extend(s.processes))
    with pytest.raises(LaunchError, match="not ready in time") as err:
        launcher.up(small_topology(model), run_dir, timeout_s=1, python=fake_python)
    assert "proxy /health: 503" in str(err.value) and "--- proxy: last lines" in str(err.value)
    assert started and not any(is_running(p) for p in started)


def test_up_waits_for_every_node(run_dir, fake_python, model, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_FAULT", "silent:prefill-1")  # the proxy is healthy, prefill-1 never registers
    with pytest.raises(LaunchError, match=r"prefill 1/2, decode 1/1 registered; proxy /health: 200") as err:
        launcher.up(small_topology(model), run_dir, timeout_s=2, python=fake_python)
    assert "--- prefill-1: last lines" in str(err.value) and "--- prefill-0" not in str(err.value)


def test_up_without_a_model_fails_before_starting_anything(tmp_path) -> None:
    with pytest.raises(LaunchError, match="no config.json"):
        launcher.up(Topology(model=str(tmp_path / "none")), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_stale_state_file_does_not_block_up(tmp_path, run_dir, fake_python, model) -> None:
    proc, rec = spawn("proxy", SLEEPER, tmp_path / "old.log")
    stop_groups([rec], grace_s=2.0)
    proc.wait(2)
    stale = launcher.RunState(cluster="pdcluster", run_dir=str(run_dir), proxy_url="http://127.0.0.1:1",
                              registry_url="redis://127.0.0.1:1/0", admin_key=False, api_key=False,
                              started_at=0.0, processes=(rec,))
    run_dir.mkdir()
    launcher.write_state(run_dir, stale)
    state = launcher.up(small_topology(model), run_dir, timeout_s=30, python=fake_python)
    assert state.proxy_url != stale.proxy_url


def test_a_port_in_use_fails_up_before_starting_anything(run_dir, fake_python, model) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        topology = Topology(model=str(model), prefill=(PrefillSpec(),), decode=(DecodeSpec(),),
                            proxy=ProxySpec(port=port))
        with pytest.raises(LaunchError, match=rf"port {port} on 127.0.0.1, for the proxy .*PORT=") as e:
            launcher.up(topology, run_dir, timeout_s=30, python=fake_python)
    assert "nothing was started" in str(e.value)
    assert launcher.read_state(run_dir) is None and not (run_dir / "logs").exists()


def test_bare_commands_find_the_one_cluster_running_elsewhere(tmp_path, run_dir, fake_python, model) -> None:
    root = run_dir.parent  # as ~/.pdcluster: the demo's run directory is one of its folders
    assert launcher.running_clusters(root) == []
    state = launcher.up(small_topology(model), run_dir, timeout_s=30, python=fake_python)
    (root / "stopped").mkdir()
    launcher.write_state(root / "stopped", replace(state, run_dir=str(root / "stopped"), processes=()))
    assert [s.run_dir for s in launcher.running_clusters(root)] == [state.run_dir]
    launcher.down(run_dir, grace_s=5.0)
    assert launcher.running_clusters(root) == []
