"""Prefix caching through the whole cluster: a shared-prefix and a multi-turn workload, caching off and on.

  python3 benchmarks/prefix_cluster.py                                   # tiny model, CPU cluster
  python3 benchmarks/prefix_cluster.py --topology benchmarks/topologies/h200x1.yaml --system-tokens 8192

The same cluster is started twice in one run (``pdctl up``'s launcher, stopped on every way out):
with ``enable_prefix_caching`` off on every node, then on. Each gets the same two workloads through
the proxy, as streaming ``/v1/completions`` with greedy, ``ignore_eos`` answers:

- **shared prefix**: ``--requests`` prompts, one shared system prompt (``--system-tokens``, 2,048)
  and a user turn of 100-300 tokens each, ``--concurrency`` at a time, ``--max-tokens`` (16) answers;
- **multi-turn**: ``--conversations`` (4) chats of ``--turns`` (10) turns, all at once, one request at
  a time each; turn t's prompt is turn t-1's prompt, its answer (``--answer-tokens``, 64; the token
  ids, asked with ``return_tokens_as_token_ids``) and a new user turn of 100-300 tokens.

Per setting and workload, from the client and the proxy's ``/metrics`` (deltas over the workload):
TTFT p50 / p99, the prefill nodes' hit rate (prompt tokens found in their prefix cache over prompt
tokens) next to the ideal (what an infinite cache would hit: the shared prompt's full blocks after
the first request; a turn's previous prompt), the prompt tokens prefilled, KV bytes moved per
request, and the decode ranks' hit rate (prompt tokens they held and did not pull; ideal: a turn's
previous prompt and answer). Greedy answers must be equal with caching off and on. The ratios
(off / on) and one JSON line come last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.append(str(Path(__file__).resolve().parent))  # appended: benchmarks/engine.py must not shadow engine/

from serve import P, Result, Target, one_request, scrape  # noqa: E402

from pdctl.launcher import down, up  # noqa: E402
from pdctl.tiny_model import make_tiny_model  # noqa: E402
from pdctl.topology import Topology, load_topology  # noqa: E402


def with_caching(topo: Topology, on: bool) -> Topology:
    """The topology with ``enable_prefix_caching`` set on every native node."""
    d = topo.to_dict()
    for role in ("prefill", "decode"):
        d[role] = [{**n, "enable_prefix_caching": on} for n in d.get(role, [])]
    return Topology.from_dict(d)


def tiny_topology(tmp: Path) -> Topology:
    model = make_tiny_model(tmp / "model", arch="v2", moe=True, seed=0)
    node = {"max_model_len": 4096, "num_kv_blocks": 2048}
    return Topology.from_dict({"model": str(model), "served_model_name": "tiny", "proxy": {"port": 0},
                               "registry": {"cluster": f"prefix-bench-{os.getpid()}"},
                               "prefill": [{**node, "max_num_batched_tokens": 4096}],
                               "decode": [{**node, "dp": 2}]})


@contextmanager
def started(topo: Topology, tmp: Path, timeout_s: float) -> Iterator[Target]:
    run_dir = tmp / f"run-{time.monotonic_ns()}"
    t0 = time.monotonic()
    state = up(topo, run_dir, timeout_s=timeout_s, progress=lambda m: None)
    print(f"cluster up in {time.monotonic() - t0:.1f} s: {state.proxy_url}", flush=True)
    try:
        vocab = json.loads((Path(topo.model) / "config.json").read_text())["vocab_size"]
        yield Target(state.proxy_url, topo.proxy.api_key, vocab)
    finally:
        down(run_dir, grace_s=10)


def user_turn(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(rng.randint(100, 300))]


def full_blocks(tokens: int, block_size: int) -> int:
    return tokens // block_size * block_size


async def shared_prefix(client: httpx.AsyncClient, model: str, args: argparse.Namespace, vocab: int,
                        block_size: int) -> tuple[list[Result], dict[str, float]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(2, vocab) for _ in range(args.system_tokens)]
    prompts = [system + user_turn(rng, vocab) for _ in range(args.requests)]
    results: list[Result | None] = [None] * len(prompts)
    queue = iter(range(len(prompts)))

    async def worker() -> None:
        for i in queue:
            results[i] = await one_request(client, model, prompts[i], args.max_tokens)

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    ideal = full_blocks(args.system_tokens, block_size) * (len(prompts) - 1)
    return [r for r in results if r is not None], {"prefill": ideal, "decode": ideal}


async def multi_turn(client: httpx.AsyncClient, model: str, args: argparse.Namespace, vocab: int,
                     block_size: int) -> tuple[list[Result], dict[str, float]]:
    ideal = {"prefill": 0.0, "decode": 0.0}

    async def chat(c: int) -> list[Result]:
        rng = random.Random(args.seed * 1000 + c)
        prompt: list[int] = []
        out = []
        for t in range(args.turns):
            prompt = prompt + user_turn(rng, vocab)
            res = await one_request(client, model, prompt, args.answer_tokens)
            out.append(res)
            if not res.ok:
                break
            if t + 1 < args.turns:  # what the next turn can find cached: this prompt; and its answer, decoded
                ideal["prefill"] += full_blocks(len(prompt), block_size)
                ideal["decode"] += full_blocks(len(prompt) + len(res.output_ids) - 1, block_size)
            prompt = prompt + res.output_ids
        return out

    chats = await asyncio.gather(*(chat(c) for c in range(args.conversations)))
    return [r for rs in chats for r in rs], ideal


def pct(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 2) if values else None


def figures(results: list[Result], before: dict[str, float], after: dict[str, float],
            ideal: dict[str, float]) -> dict[str, Any]:
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    ok = [r for r in results if r.ok]
    prompt = delta.get(f"{P}prompt_tokens_total", 0.0)
    cached = {leg: delta.get(f"{P}prefix_cached_tokens_total:{leg}", 0.0) for leg in ("prefill", "decode")}
    return {
        "requests": len(results), "ok": len(ok),
        "ttft_p50_ms": pct([r.ttft for r in ok], 50), "ttft_p99_ms": pct([r.ttft for r in ok], 99),
        "prompt_tokens": prompt,
        "prefill_tokens_computed": prompt - cached["prefill"],
        "prefill_hit_rate": round(cached["prefill"] / prompt, 4) if prompt else None,
        "prefill_ideal_hit_rate": round(ideal["prefill"] / prompt, 4) if prompt else None,
        "decode_hit_rate": round(cached["decode"] / prompt, 4) if prompt else None,
        "decode_ideal_hit_rate": round(ideal["decode"] / prompt, 4) if prompt else None,
        "kv_bytes_per_request": round(delta.get(f"{P}kv_transfer_bytes_total", 0.0) / max(1, len(results))),
        "answers": [r.output_ids for r in results],
    }


async def run_setting(target: Target, args: argparse.Namespace, block_size: int) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    async with httpx.AsyncClient(base_url=target.url, headers=headers, trust_env=False,
                                 timeout=httpx.Timeout(args.request_timeout, connect=10.0)) as client:
        model = (await client.get("/v1/models")).raise_for_status().json()["data"][0]["id"]
        out = {}
        for name, workload in (("shared_prefix", shared_prefix), ("multi_turn", multi_turn)):
            before = await scrape_legs(client)
            results, ideal = await workload(client, model, args, target.vocab, block_size)
            # Several proxy workers: a page has the others' series as of their last flush (FLUSH_S = 1 s).
            await asyncio.sleep(args.settle_s)
            out[name] = figures(results, before, await scrape_legs(client), ideal)
        return out


async def scrape_legs(client: httpx.AsyncClient) -> dict[str, float]:
    """The proxy's series (``serve.scrape``), and the prefix-cached tokens by leg."""
    totals = await scrape(client)
    text = (await client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith(f"{P}prefix_cached_tokens_total{{"):
            leg = line.split('leg="', 1)[1].split('"', 1)[0]
            totals[f"{P}prefix_cached_tokens_total:{leg}"] = float(line.rsplit(" ", 1)[1])
    return totals


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", help="the cluster (a pdctl topology YAML; default: a tiny CPU cluster)")
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=24, help="shared-prefix requests")
    ap.add_argument("--concurrency", type=int, default=2, help="shared-prefix requests in flight")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16, help="shared-prefix answers' tokens")
    ap.add_argument("--answer-tokens", type=int, default=64, help="multi-turn answers' tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--settle-s", type=float, default=1.2,
                    help="wait before reading the proxy's metrics after a workload (its workers flush every 1 s)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="prefix-bench-") as tmp:
        base = load_topology(Path(args.topology)) if args.topology else tiny_topology(Path(tmp))
        block_size = base.prefill[0].value("block_size")
        for on in (False, True):
            topo = with_caching(base, on)
            with started(topo, Path(tmp), args.start_timeout) as target:
                out["on" if on else "off"] = asyncio.run(run_setting(target, args, block_size))
    summary: dict[str, Any] = {"benchmark": "prefix_cluster", "topology": args.topology or "tiny-cpu",
                               "system_tokens": args.system_tokens, "requests": args.requests,
                               "concurrency": args.concurrency, "conversations": args.conversations,
                               "turns": args.turns, "max_tokens": args.max_tokens,
                               "answer_tokens": args.answer_tokens, "cores": os.cpu_count()}
    print(f"\n{'workload':14} {'caching':8} {'TTFT p50':>9} {'p99':>8} {'prefill hit':>11} {'(ideal)':>8} "
          f"{'prefilled':>10} {'decode hit':>10} {'(ideal)':>8} {'KV B/req':>11}")
    for w in ("shared_prefix", "multi_turn"):
        off, on = out["off"][w], out["on"][w]
        for name, f in (("off", off), ("on", on)):
            print(f"{w:14} {name:8} {f['ttft_p50_ms']:9.1f} {f['ttft_p99_ms']:8.1f} {f['prefill_hit_rate']:11.1%} "
                  f"{f['prefill_ideal_hit_rate']:8.1%} {f['prefill_tokens_computed']:10.0f} "
                  f"{f['decode_hit_rate']:10.1%} {f['decode_ideal_hit_rate']:8.1%} {f['kv_bytes_per_request']:11,}")
        same = off.pop("answers") == on.pop("answers")
        summary[w] = {"off": off, "on": on, "answers_equal": same,
                      "ttft_p50_ratio": ratio(off["ttft_p50_ms"], on["ttft_p50_ms"]),
                      "prefill_tokens_ratio": ratio(off["prefill_tokens_computed"], on["prefill_tokens_computed"]),
                      "kv_bytes_ratio": ratio(off["kv_bytes_per_request"], on["kv_bytes_per_request"]),
                      "prefill_hit_of_ideal": ratio(on["prefill_hit_rate"], on["prefill_ideal_hit_rate"]),
                      "decode_hit_of_ideal": ratio(on["decode_hit_rate"], on["decode_ideal_hit_rate"])}
        s = summary[w]
        print(f"{w}: TTFT p50 {s['ttft_p50_ratio']}x lower, {s['prefill_tokens_ratio']}x fewer tokens prefilled, "
              f"{s['kv_bytes_ratio']}x fewer KV bytes per request; hit rate {s['prefill_hit_of_ideal']} (prefill) "
              f"and {s['decode_hit_of_ideal']} (decode) of the ideal; answers equal: {same}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
