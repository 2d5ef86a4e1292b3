"""vLLM nodes on CPU: request times with OpenMP threads that spin, spin a while, or sleep when idle.

  /opt/vllm-venv/bin/python benchmarks/vllm_cpu_wait.py              # 12 requests per setting
  /opt/vllm-venv/bin/python benchmarks/vllm_cpu_wait.py --rounds 5

A cluster like ``tests/vllm_backend/test_vllm_cluster.py``'s, without its native prefill node (vLLM
TP 2 prefill -> vLLM decode, the tiny MLA model, float32), is started by the launcher ``pdctl up``
uses, once per setting of ``OMP_WAIT_POLICY``:

- ``ACTIVE``: threads always spin;
- ``default``: the variable unset (the nodes keep it unset when it is empty): torch's libgomp spins a
  while (``GOMP_SPINCOUNT``), then sleeps. This is what vllm-cpu gets when nothing sets it;
- ``PASSIVE``: threads sleep. The nodes set this on CPU.

Each run sends the test's four prompts ``--rounds`` times, one request at a time, with 16 greedy
tokens each. The script reports each setting's median and slowest request time (the first round
is left out), the ratio of each median to PASSIVE's, and the pulls the decode node logged as slower
than 1 s. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "vllm_backend"))

import openai  # noqa: E402
from vllm_common import PROMPTS  # noqa: E402

from pdctl.launcher import down, up  # noqa: E402
from pdctl.tiny_model import make_tiny_model  # noqa: E402
from pdctl.topology import DecodeSpec, PrefillSpec, ProxySpec, RegistrySpec, Topology  # noqa: E402

NODE = dict(dtype="float32", max_model_len=256)
# kv_transfer.handoff.KVReceiver.pull's line (a warning above SLOW_PULL_S, so it reaches the log).
SLOW_PULL = re.compile(r"pulled \S+: (\d+) bytes from \d+ sources in ([\d.]+)s")
SLOW_PULL_S = 1.0
SETTINGS = {"ACTIVE": "ACTIVE", "default": "", "PASSIVE": "PASSIVE"}  # name -> OMP_WAIT_POLICY


def run(model: Path, name: str, rounds: int, work: Path) -> dict:
    os.environ["OMP_WAIT_POLICY"] = SETTINGS[name]  # the nodes (and vLLM's processes) inherit it
    topo = Topology(model=str(model), served_model_name="tiny", engine="vllm", vllm_python=sys.executable,
                    prefill=(PrefillSpec(max_num_batched_tokens=256, tp=2, **NODE),),
                    decode=(DecodeSpec(**NODE),), proxy=ProxySpec(port=0),
                    registry=RegistrySpec(cluster=f"bench-{name.lower()}"))
    run_dir = work / name.lower()
    print(f"== OMP_WAIT_POLICY {name}: starting the cluster", flush=True)
    state = up(topo, run_dir, timeout_s=500)
    times, errors = [], 0
    try:
        oa = openai.OpenAI(base_url=f"{state.proxy_url}/v1", api_key="unused", max_retries=0, timeout=120)
        for r in range(rounds):
            for prompt in PROMPTS:
                t0 = time.perf_counter()
                try:
                    oa.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0.0,
                                          extra_body={"ignore_eos": True})
                except openai.APIError as e:
                    errors += 1
                    print(f"   request failed: {e}", flush=True)
                times.append(time.perf_counter() - t0)
            print(f"   round {r + 1}/{rounds}: {[round(t, 2) for t in times[-len(PROMPTS):]]} s", flush=True)
    finally:
        down(run_dir, grace_s=10)
    pulls = SLOW_PULL.findall((run_dir / "logs" / "decode-0.log").read_text())
    slow = [(int(b), float(s)) for b, s in pulls if float(s) > SLOW_PULL_S]
    # The first round includes each engine's first-request work: report the rest.
    steady = times[len(PROMPTS):] or times
    return {"median_s": statistics.median(steady), "max_s": max(steady), "errors": errors,
            "slow_pulls": len(slow), "slowest_pull_s": max((s for _, s in slow), default=0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory(prefix="vllm-cpu-wait-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "model", arch="v2", moe=True, seed=0)
        results = {name: run(model, name, args.rounds, work) for name in SETTINGS}
    passive = results["PASSIVE"]["median_s"]
    print(f"{'policy':8} {'median':>8} {'slowest':>8} {'errors':>6} {'slow pulls':>10} {'/ PASSIVE':>10}")
    for name, r in results.items():
        r["median_over_passive"] = round(r["median_s"] / passive, 3)
        print(f"{name:8} {r['median_s']:8.2f} {r['max_s']:8.2f} {r['errors']:6d} {r['slow_pulls']:10d} "
              f"{r['median_over_passive']:9.2f}x")
    print(f"{os.cpu_count()} cores")
    print(json.dumps({"benchmark": "vllm_cpu_wait", "cores": os.cpu_count(), "rounds": args.rounds, **results}))


if __name__ == "__main__":
    main()
