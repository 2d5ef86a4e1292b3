"""``benchmarks/serve.py`` end to end: its tiny CPU cluster, a short load, every request accounted for.

The benchmark runs as users run it (a subprocess) with its temporary files under the test's own
directory, so that any process it left behind (nodes, proxy, redis: their command lines name that
directory) can be found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240  # it takes about 15 s on 2 cores
REQUESTS, WARMUP = 8, 2
KEYS = {"benchmark", "url", "model", "max_model_len", "mode", "concurrency", "rate", "requests", "warmup",
        "max_tokens", "prompt_mix", "clipped_prompts", "sent", "ok", "failed", "errors", "measured", "measured_ok",
        "window_s", "prompt_len", "request_throughput", "output_throughput", "ttft_ms", "tpot_ms", "itl_ms",
        "e2e_ms", "goodput", "proxy"}
PROXY_KEYS = {"mean_ttft_s", "mean_itl_s", "mean_e2e_s", "mean_kv_transfer_s", "kv_transfer_bytes",
              "generation_tokens", "prompt_tokens", "errors", "mean_prefill_queue_s", "mean_prefill_s",
              "mean_prefill_rpc_s", "mean_decode_admission_s", "mean_first_decode_token_s"}


def processes_naming(text: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if any(text in arg for arg in p.cmdline()):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def test_serve_benchmark_tiny_cluster(tmp_path: Path) -> None:
    cmd = [sys.executable, "benchmarks/serve.py", "--requests", str(REQUESTS), "--warmup", str(WARMUP),
           "--concurrency", "2", "--max-tokens", "4", "--keep-logs", str(tmp_path / "logs")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the benchmark stops its cluster on the way out
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"benchmarks/serve.py did not finish in {TIMEOUT_S} s:\n{out[-4000:]}")
    finally:
        left = processes_naming(str(tmp_path))
        for p in left:
            p.kill()
    assert proc.returncode == 0, out[-4000:]
    assert not left, f"the benchmark left processes behind: {[(p.pid, p.name()) for p in left]}"

    result = json.loads(out.strip().splitlines()[-1])
    assert KEYS <= result.keys(), KEYS - result.keys()
    kept = {log.name: log.stat().st_size for log in (tmp_path / "logs").glob("*.log")}  # --keep-logs
    assert {"prefill-0.log", "decode-0.log", "proxy.log"} <= kept.keys() and all(kept.values()), kept
    assert PROXY_KEYS <= result["proxy"].keys(), PROXY_KEYS - result["proxy"].keys()
    assert result["benchmark"] == "serve" and result["mode"] == "closed"
    assert result["sent"] == REQUESTS + WARMUP
    assert result["ok"] == result["sent"] and result["failed"] == 0 and result["errors"] == {}
    assert result["measured"] == result["measured_ok"] == REQUESTS
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(result[name]) == {"mean", "p50", "p90", "p99"}
        assert 0 <= result[name]["p50"] <= result[name]["p90"] <= result[name]["p99"], result[name]
    assert result["ttft_ms"]["p50"] <= result["e2e_ms"]["p50"]
    assert result["output_throughput"] > 0 and 0 <= result["goodput"]["fraction"] <= 1
    # The proxy saw exactly the measured requests, each with its KV transfer and all its tokens.
    proxy = result["proxy"]
    assert proxy["ttft_s_count"] == proxy["kv_transfer_s_count"] == REQUESTS
    # Every phase was observed once per request; the node's queue and compute fit in the Prefill call.
    for phase in ("prefill_queue_s", "prefill_s", "prefill_rpc_s", "decode_admission_s", "first_decode_token_s"):
        assert proxy[f"{phase}_count"] == REQUESTS, phase
    assert proxy["mean_prefill_queue_s"] + proxy["mean_prefill_s"] <= proxy["mean_prefill_rpc_s"]
    assert proxy["generation_tokens"] == REQUESTS * 4 and proxy["errors"] == 0
