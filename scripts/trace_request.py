"""Which of the repository's files one streamed chat request enters, in every process of a local cluster.

    python3 scripts/trace_request.py [--model models/tiny] [--json]

Starts a cluster (redis, a PCP2 prefill node with sharded KV, a DP2 decode node with its replicas as
processes and overlapped steps, as GPU nodes run, the proxy) with a profiler installed at start-up in
every Python process it spawns (a ``sitecustomize`` module on ``PYTHONPATH``), records the files
whose functions are called while one streamed chat request runs, and, as a control, while the
cluster idles for as long. Prints, per process role, the files of the request, marking those the idle
window entered too (background work: heartbeats, the registry view, idle engine loops). The table
"One request, end to end" in docs/architecture.md is checked against this list.

The profiler slows every process while it runs; the figures it prints are files, not times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]

# Installed in every process of the cluster: a profile function (all threads started from then on) that
# adds the file of each called function under ROOT to a set while PDTRACE_DIR/arm exists; a thread that
# watches the control files and writes the set to PDTRACE_DIR/<pid>.json when PDTRACE_DIR/dump-<n> appears.
SITECUSTOMIZE = r'''
import json, os, sys, threading, time
_dir = os.environ.get("PDTRACE_DIR")
if _dir:
    _root = os.environ["PDTRACE_ROOT"]
    _seen = set()
    _state = {"armed": False}

    def _prof(frame, event, arg):
        if _state["armed"] and event == "call":
            f = frame.f_code.co_filename
            if f.startswith(_root):
                _seen.add(f)

    sys.setprofile(_prof)
    threading.setprofile(_prof)

    def _watch():
        done = set()
        while True:
            _state["armed"] = os.path.exists(os.path.join(_dir, "arm"))
            for name in os.listdir(_dir):
                if name.startswith("dump-") and name not in done:
                    done.add(name)
                    with open(os.path.join(_dir, f"{os.getpid()}-{name[5:]}.json"), "w") as out:
                        json.dump({"argv": sys.argv, "files": sorted(_seen)}, out)
                    _seen.clear()
            time.sleep(0.02)

    threading.Thread(target=_watch, name="pdtrace", daemon=True).start()
'''

TOPOLOGY = """\
model: {model}
served_model_name: tiny
registry: {{cluster: trace-{pid}}}
proxy: {{port: 0}}
prefill: [{{dp: 1, pcp: 2, pp: 1, kv_layout: sharded}}]
decode: [{{dp: 2, dp_processes: "on", async_scheduling: true}}]
"""


def role(argv: list[str]) -> str:
    text = " ".join(argv)
    for name in ("prefill_node", "decode_node", "proxy"):
        if f"-m {name}" in text or f"{name}/__main__" in text or text.endswith(name):
            return name
    if "multiprocessing" in text or "spawn" in text:
        return "spawned"
    return argv[0] if argv else "?"


def window(trace: Path, n: int, action: object) -> None:
    """Arm the profilers, run ``action`` (a callable, or seconds to sleep), disarm, dump window ``n``."""
    (trace / "arm").touch()
    time.sleep(0.2)  # every watcher has seen it
    if callable(action):
        action()
    else:
        time.sleep(float(action))  # type: ignore[arg-type]
    (trace / "arm").unlink()
    time.sleep(0.2)
    (trace / f"dump-{n}").touch()
    time.sleep(1.0)


def collect(trace: Path, n: int, roles: dict[int, str]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in trace.glob(f"*-{n}.json"):
        pid = int(f.name.split("-")[0])
        data = json.loads(f.read_text())
        who = roles.get(pid) or role(data["argv"])
        out.setdefault(who, set()).update(str(Path(p).relative_to(ROOT)) for p in data["files"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny"))
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the lists")
    args = ap.parse_args()
    model = Path(args.model).resolve()
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "pdctl.cli", "make-model", str(model), "--seed", "0"], check=True,
                       cwd=ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        site, trace, run_dir = tmp_path / "site", tmp_path / "trace", tmp_path / "run"
        site.mkdir()
        trace.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        topo = tmp_path / "topology.yaml"
        topo.write_text(TOPOLOGY.format(model=model, pid=os.getpid()))
        env = dict(os.environ, PDTRACE_DIR=str(trace), PDTRACE_ROOT=str(ROOT) + os.sep,
                   PYTHONPATH=os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]))
        pdctl = [sys.executable, "-m", "pdctl.cli"]
        subprocess.run([*pdctl, "up", "--topology", str(topo), "--run-dir", str(run_dir)], check=True, env=env,
                       cwd=ROOT, stdout=subprocess.DEVNULL)
        try:
            state = json.loads((run_dir / "state.json").read_text())
            roles: dict[int, str] = {}
            for p in state["processes"]:
                name = p["name"].split("-")[0]  # prefill-0 -> prefill
                try:
                    proc = psutil.Process(p["pid"])
                    for q in [proc, *proc.children(recursive=True)]:
                        roles[q.pid] = {"prefill": "prefill_node", "decode": "decode_node"}.get(name, name)
                except psutil.NoSuchProcess:
                    pass
            url = state["proxy_url"]
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                    "temperature": 0, "stream": True}
            with httpx.Client(timeout=120) as client:
                client.post(f"{url}/v1/chat/completions", json=dict(body, stream=False)).raise_for_status()  # warm

                def request() -> None:
                    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                        r.raise_for_status()
                        for _ in r.iter_lines():
                            pass

                t0 = time.monotonic()
                window(trace, 1, request)
                took = time.monotonic() - t0
            window(trace, 2, took)  # the control: as long, no request
            got, idle = collect(trace, 1, roles), collect(trace, 2, roles)
        finally:
            subprocess.run([*pdctl, "down", "--run-dir", str(run_dir)], env=env, cwd=ROOT,
                           stdout=subprocess.DEVNULL)
    if args.json:
        print(json.dumps({who: {"request": sorted(files), "idle_too": sorted(files & idle.get(who, set()))}
                          for who, files in sorted(got.items())}))
        return
    union = set().union(*got.values()) if got else set()
    for who, files in sorted(got.items()):
        print(f"== {who}: {len(files)} files ({len(files - idle.get(who, set()))} not entered while idle)")
        for f in sorted(files):
            print(f"  {f}{'   (idle too)' if f in idle.get(who, set()) else ''}")
    print(f"== in all: {len(union)} files")


if __name__ == "__main__":
    main()
