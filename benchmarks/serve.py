"""Serving benchmark: the whole cluster through the proxy, measured from the client side.

  python3 benchmarks/serve.py                                  # tiny random model, CPU cluster (1 prefill, 1 decode)
  python3 benchmarks/serve.py --topology cluster.yaml --concurrency 16 --requests 256 --prompt-len 512:4096
  python3 benchmarks/serve.py --url http://127.0.0.1:8000 --rate 4 --prompt-mix long --max-tokens 256

With ``--topology`` the cluster is started with ``pdctl up``'s launcher in a temporary run directory
and stopped on every way out (an error, Ctrl-C, SIGTERM); with ``--url`` a running proxy is used; with
neither, a tiny random model is written and a CPU cluster of one prefill node (PCP 1) and one decode
node is started. Load: a closed loop of ``--concurrency`` clients, or open-loop Poisson arrivals at
``--rate`` req/s (``--concurrency`` then caps the requests in flight). ``--warmup`` requests run first
and are left out of the figures.

Each request is ``/v1/completions`` with random token ids as the prompt (``--seed``), streaming, with
``ignore_eos`` so it makes exactly ``--max-tokens`` tokens, and ``logprobs: 1``: a chunk's tokens are
counted from ``logprobs.tokens``, asked as ids (``return_tokens_as_token_ids``; the proxy may hold
back the text of a partial character). Per request:
TTFT (to the first chunk that carries a token), ITL (the gap between token-carrying chunks, spread over
the chunk's tokens; tokens arriving with the first one count 0), TPOT ((e2e - TTFT) / (tokens - 1)) and
e2e (to the end of the stream). Goodput: the requests meeting both ``--slo-ttft-ms`` and ``--slo-tpot-ms``.
The proxy's own view is the mean of its histograms over the run (``/metrics`` scraped before and after
the measured requests). A table, then one JSON line with every figure, last.

``--schema medium`` (or a JSON schema file) measures structured output's cost: after the plain pass as
many prompts again (new ones, of the same lengths' mix) run with ``response_format`` ``json_schema`` (the
output may then end before
``--max-tokens``, where the grammar ends), and ``structured_tpot_p50_ratio`` is its TPOT p50 over the
plain pass's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdctl.launcher import down, up  # noqa: E402
from pdctl.tiny_model import make_tiny_model  # noqa: E402
from pdctl.topology import DecodeSpec, PrefillSpec, ProxySpec, RegistrySpec, Topology, load_topology  # noqa: E402
from proxy.metrics import FLUSH_S  # noqa: E402

# --prompt-mix long: (weight, shortest, longest) prompt lengths, uniform within a bucket.
LONG_MIX = ((0.35, 1024, 4096), (0.30, 4096, 8192), (0.20, 8192, 16384), (0.15, 16384, 32768))
URL_VOCAB = 1000  # --url without --vocab-size: ids below this exist in any real vocabulary
# The proxy's series (proxy/metrics.py): histograms reported as their mean over the run, and counters.
P = "pdcluster_proxy_"
PROXY_HISTOGRAMS = {"ttft_s": "time_to_first_token_seconds", "itl_s": "inter_token_latency_seconds",
                    "e2e_s": "request_latency_seconds", "kv_transfer_s": "kv_transfer_seconds",
                    # the phases: prefill queue and compute (the node's report), the Prefill call as the
                    # proxy saw it, and the decode call to admission and to its first tokens
                    "prefill_queue_s": "prefill_queue_seconds", "prefill_s": "prefill_seconds",
                    "prefill_rpc_s": "prefill_rpc_seconds", "decode_admission_s": "decode_admission_seconds",
                    "first_decode_token_s": "first_decode_token_seconds"}
PROXY_COUNTERS = {"kv_transfer_bytes": "kv_transfer_bytes_total", "generation_tokens": "generation_tokens_total",
                  "prompt_tokens": "prompt_tokens_total"}
QUANTILES = (50, 90, 99)


@dataclass
class Result:
    """One request, as the client saw it (times in seconds from its start)."""

    prompt_len: int
    ok: bool = False
    error: str = ""  # "http 503 overloaded", "stream kv_transfer_failed", "client ReadTimeout", ...
    ttft: float = math.nan
    e2e: float = math.nan
    tokens: int = 0
    itl: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)  # from "token_id:<id>" logprobs tokens

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else math.nan


@dataclass(frozen=True)
class Target:
    url: str
    api_key: str | None
    vocab: int


def prompt_lengths(args: argparse.Namespace, n: int, limit: int, rng: random.Random) -> tuple[list[int], int]:
    """``n`` prompt lengths from the mix, each clipped so prompt + max_tokens fits ``limit``; and how many were."""
    if args.prompt_mix == "long":
        weights = [w for w, _, _ in LONG_MIX]
        lens = [rng.randint(lo, hi) for _, lo, hi in rng.choices(LONG_MIX, weights, k=n)]
    else:
        lo, _, hi = args.prompt_len.partition(":")
        lens = [rng.randint(int(lo), int(hi or lo)) for _ in range(n)]
    top = limit - args.max_tokens
    if top < 1:
        raise SystemExit(f"--max-tokens {args.max_tokens} leaves no room for a prompt in max_model_len {limit}")
    return [min(n_, top) for n_ in lens], sum(n_ > top for n_ in lens)


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                      extra: dict[str, Any] | None = None) -> Result:
    """Send one streaming completion (with the ``extra`` body fields) and time its token-carrying chunks."""
    res = Result(len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "logprobs": 1, "temperature": 0.0, "return_tokens_as_token_ids": True, **(extra or {})}
    t0 = last = time.perf_counter()
    done = False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                res.error = f"http {r.status_code} {_error_code(r.content)}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream {chunk['error'].get('code') or chunk['error'].get('type')}"
                    return res
                toks = ((chunk.get("choices") or [{}])[0].get("logprobs") or {}).get("tokens") or []
                k = len(toks)
                if not k:
                    continue
                res.output_ids += [int(t.removeprefix("token_id:")) if t.startswith("token_id:") else -1 for t in toks]
                now = time.perf_counter()
                if res.tokens == 0:
                    res.ttft = now - t0
                    res.itl += [0.0] * (k - 1)
                else:
                    res.itl += [(now - last) / k] * k
                res.tokens += k
                last = now
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"client {type(e).__name__}"
        return res
    res.e2e = time.perf_counter() - t0
    if not done:
        res.error = "stream ended without [DONE]"
    elif res.tokens != max_tokens and not (extra and 0 < res.tokens < max_tokens):  # a grammar may end first
        res.error = f"got {res.tokens} tokens, not {max_tokens}"
    res.ok = not res.error
    return res


def _error_code(content: bytes) -> str:
    try:
        err = json.loads(content)["error"]
        return str(err.get("code") or err.get("type"))
    except (ValueError, KeyError, TypeError):
        return "non_json"


async def run_load(client: httpx.AsyncClient, model: str, prompts: Sequence[list[int]], args: argparse.Namespace,
                   rng: random.Random, extra: dict[str, Any] | None = None) -> list[Result]:
    """Closed loop (``--concurrency`` workers) or open loop (Poisson arrivals at ``--rate``)."""
    results: list[Result | None] = [None] * len(prompts)
    if args.rate is None:
        queue = iter(range(len(prompts)))

        async def worker() -> None:
            for i in queue:  # shared: each index goes to one worker
                results[i] = await one_request(client, model, prompts[i], args.max_tokens, extra)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    else:
        cap = asyncio.Semaphore(args.concurrency or len(prompts))

        async def send(i: int) -> None:
            async with cap:
                results[i] = await one_request(client, model, prompts[i], args.max_tokens, extra)

        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.ensure_future(send(i)))
            if i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """The proxy's ``/metrics``: every sample's value, summed over its labels."""
    text = (await client.get("/metrics")).raise_for_status().text
    totals: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            totals[s.name] += s.value
            if "cause" in s.labels:  # the errors counter, also by cause
                totals[f"{s.name}:{s.labels['cause']}"] += s.value
    return dict(totals)


def proxy_view(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Means of the proxy's histograms over the run (sum/count deltas), and its counters' deltas."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    out: dict[str, Any] = {}
    for key, name in PROXY_HISTOGRAMS.items():
        count = delta.get(f"{P}{name}_count", 0.0)
        out[f"mean_{key}"] = delta.get(f"{P}{name}_sum", 0.0) / count if count else None
        out[f"{key}_count"] = count
    out.update({key: delta.get(f"{P}{name}", 0.0) for key, name in PROXY_COUNTERS.items()})
    kv_s, kv_bytes = delta.get(f"{P}kv_transfer_seconds_sum", 0.0), delta.get(f"{P}kv_transfer_bytes_total", 0.0)
    out["kv_transfer_gb_per_s"] = kv_bytes / kv_s / 1e9 if kv_s else None
    out["errors"] = delta.get(f"{P}errors_total", 0.0)
    by_cause = f"{P}errors_total:"
    out["errors_by_cause"] = {k.removeprefix(by_cause): v for k, v in delta.items() if k.startswith(by_cause) and v}
    return out


def stats(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    """Mean and percentiles, in ms (``scale``); None when there is nothing to summarize."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return {"mean": None, **{f"p{q}": None for q in QUANTILES}}
    pct = np.percentile(vals, QUANTILES)
    return {"mean": round(float(np.mean(vals)) * scale, 3),
            **{f"p{q}": round(float(p) * scale, 3) for q, p in zip(QUANTILES, pct)}}


def summarize(measured: list[Result], every: list[Result], window_s: float, args: argparse.Namespace,
              proxy: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in measured if r.ok]
    good = [r for r in ok if r.ttft * 1000 <= args.slo_ttft_ms
            and (math.isnan(r.tpot) or r.tpot * 1000 <= args.slo_tpot_ms)]
    errors = Counter(r.error for r in every if not r.ok)
    lens = [r.prompt_len for r in measured]
    return {
        "sent": len(every), "ok": sum(r.ok for r in every), "failed": sum(not r.ok for r in every),
        "errors": dict(errors), "measured": len(measured), "measured_ok": len(ok), "window_s": round(window_s, 3),
        "prompt_len": {"mean": round(float(np.mean(lens)), 1), "min": min(lens), "max": max(lens)},
        "request_throughput": round(len(ok) / window_s, 3),
        "output_throughput": round(sum(r.tokens for r in ok) / window_s, 2),
        "ttft_ms": stats([r.ttft for r in ok]), "tpot_ms": stats([r.tpot for r in ok]),
        "itl_ms": stats([g for r in ok for g in r.itl]), "e2e_ms": stats([r.e2e for r in ok]),
        "goodput": {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
                    "fraction": round(len(good) / len(measured), 4), "rate": round(len(good) / window_s, 3)},
        "proxy": {k: (round(v, 6) if isinstance(v, float) else v) for k, v in proxy.items()},
    }


def print_table(s: dict[str, Any]) -> None:
    def ms(v: float | None) -> str:
        return f"{v:10.1f}" if v is not None else f"{'-':>10}"

    print(f"\n{'ms':8} {'mean':>10} {'p50':>10} {'p90':>10} {'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        row = s[f"{name}_ms"]
        print(f"{name.upper():8} {ms(row['mean'])} " + " ".join(ms(row[f'p{q}']) for q in QUANTILES))
    g, p = s["goodput"], s["proxy"]
    print(f"requests: {s['sent']} sent, {s['ok']} ok, {s['failed']} failed{_causes(s['errors'])}; measured "
          f"{s['measured']} over {s['window_s']:.2f} s (prompts {s['prompt_len']['min']}-{s['prompt_len']['max']}, "
          f"mean {s['prompt_len']['mean']})")
    print(f"throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s")
    print(f"goodput (TTFT <= {g['slo_ttft_ms']:g} ms, TPOT <= {g['slo_tpot_ms']:g} ms): "
          f"{g['fraction']:.1%} of requests, {g['rate']:.2f} req/s")
    means = ", ".join(f"{k.removeprefix('mean_').removesuffix('_s')} {v * 1000:.1f} ms" for k, v in p.items()
                      if k.startswith("mean_") and v is not None)
    gbps = f", {p['kv_transfer_gb_per_s']:.3f} GB/s" if p["kv_transfer_gb_per_s"] else ""
    print(f"proxy (means over the run): {means or 'none'}; KV {p['kv_transfer_bytes'] / 1e6:.1f} MB moved{gbps}; "
          f"{p['errors']:g} errors{_causes(p['errors_by_cause'])}")


def _causes(counts: dict[str, float]) -> str:
    return f" ({', '.join(f'{k}: {v:g}' for k, v in counts.items())})" if counts else ""


@contextlib.contextmanager
def cluster(args: argparse.Namespace) -> Iterator[Target]:
    """The proxy to load: ``--url``, or a cluster started here (and stopped however we leave)."""
    api_key = args.api_key or os.environ.get("PDCLUSTER_API_KEY")
    if args.url:
        yield Target(args.url.rstrip("/"), api_key, args.vocab_size or URL_VOCAB)
        return
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        if args.topology:
            topo = load_topology(Path(args.topology))
        else:
            model = make_tiny_model(Path(tmp) / "model", arch="v2", moe=True, seed=0)
            topo = Topology(model=str(model), served_model_name="tiny", prefill=(PrefillSpec(),),
                            decode=(DecodeSpec(),), proxy=ProxySpec(port=0),
                            registry=RegistrySpec(cluster=f"serve-bench-{os.getpid()}"))
        vocab = args.vocab_size or json.loads((Path(topo.model) / "config.json").read_text())["vocab_size"]
        run_dir = Path(tmp) / "run"
        t0 = time.monotonic()

        def say(msg: str) -> None:
            if not msg.startswith("waiting"):  # up polls every 0.2 s: only what it starts
                print(f"   {msg}", flush=True)

        state = up(topo, run_dir, timeout_s=args.start_timeout, progress=say)
        print(f"cluster up in {time.monotonic() - t0:.1f} s: {state.proxy_url}", flush=True)
        try:
            yield Target(state.proxy_url, topo.proxy.api_key or api_key, vocab)
        finally:
            down(run_dir, grace_s=10)
            if args.keep_logs:  # (the run directory goes with the temporary one)
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                for log in (run_dir / "logs").glob("*.log"):
                    shutil.copy(log, args.keep_logs / log.name)
                print(f"node logs in {args.keep_logs}", flush=True)


async def bench(target: Target, args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    conns = args.concurrency or None
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    async with httpx.AsyncClient(base_url=target.url, headers=headers, limits=limits, trust_env=False,
                                 timeout=httpx.Timeout(args.request_timeout, connect=10.0)) as client:
        card = (await client.get("/v1/models")).raise_for_status().json()["data"][0]
        rng = random.Random(args.seed)
        n = args.warmup + args.requests
        passes = 2 if args.schema else 1  # the schema's pass gets prompts of its own (no prefix cache hits)
        lens, clipped = prompt_lengths(args, n * passes, int(card["max_model_len"]), rng)
        prompts = [[rng.randrange(target.vocab) for _ in range(k)] for k in lens]
        mode = f"Poisson {args.rate:g} req/s" if args.rate else f"concurrency {args.concurrency}"
        print(f"model {card['id']} (max_model_len {card['max_model_len']}) at {target.url}: {args.warmup} warmup + "
              f"{args.requests} requests, {mode}, {args.max_tokens} output tokens each", flush=True)
        summary = await measure(client, card["id"], prompts[:n], args, rng)
        structured: dict[str, Any] = {}
        if args.schema:
            print(f"again with response_format json_schema ({args.schema}), other prompts", flush=True)
            s = await measure(client, card["id"], prompts[n:], args, rng, structured_body(args.schema))
            plain, constrained = summary["tpot_ms"]["p50"], s["tpot_ms"]["p50"]
            structured = {"schema": args.schema, "structured": s, "structured_tpot_p50_ratio":
                          round(constrained / plain, 4) if plain and constrained else None}
    return {"benchmark": "serve", "url": target.url, "model": card["id"], "max_model_len": card["max_model_len"],
            "mode": "open" if args.rate else "closed", "concurrency": args.concurrency, "rate": args.rate,
            "requests": args.requests, "warmup": args.warmup, "max_tokens": args.max_tokens,
            "prompt_mix": args.prompt_mix or args.prompt_len, "clipped_prompts": clipped, "seed": args.seed,
            "cores": os.cpu_count(), **summary, **structured}


async def measure(client: httpx.AsyncClient, model: str, prompts: list[list[int]], args: argparse.Namespace,
                  rng: random.Random, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The warmup requests, then the measured ones between two scrapes of the proxy's metrics."""
    warm = await run_load(client, model, prompts[:args.warmup], args, rng, extra)
    # A proxy worker's page has the other workers' series as of their last flush (FLUSH_S ago at most).
    await asyncio.sleep(FLUSH_S + 0.2)
    before = await scrape(client)
    t0 = time.perf_counter()
    measured = await run_load(client, model, prompts[args.warmup:], args, rng, extra)
    window = time.perf_counter() - t0
    await asyncio.sleep(FLUSH_S + 0.2)
    after = await scrape(client)
    return summarize(measured, warm + measured, window, args, proxy_view(before, after))


def structured_body(schema: str) -> dict[str, Any]:
    """``response_format`` for ``--schema``: "medium" (benchmarks/presets.py) or a JSON schema file."""
    from presets import MEDIUM_SCHEMA

    spec = MEDIUM_SCHEMA if schema == "medium" else json.loads(Path(schema).read_text())
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": spec}}}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--topology", help="start this cluster (a pdctl topology YAML)")
    where.add_argument("--url", help="a running proxy, e.g. http://127.0.0.1:8000")
    ap.add_argument("--api-key", help="the proxy's API key (default: $PDCLUSTER_API_KEY, or the topology's)")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="closed loop: clients (default 4); with --rate: most requests in flight (default: no cap)")
    ap.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals, requests per second")
    ap.add_argument("--requests", type=int, default=48, help="measured requests")
    ap.add_argument("--warmup", type=int, default=4, help="requests sent first, left out of the figures")
    mix = ap.add_mutually_exclusive_group()
    mix.add_argument("--prompt-len", default="64:512", help="prompt tokens: N, or LO:HI (uniform)")
    mix.add_argument("--prompt-mix", choices=["long"], help="long: 1k-32k tokens, clipped to max_model_len")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens of every request (ignore_eos)")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=0, help="prompts, prompt lengths and arrival times")
    ap.add_argument("--vocab-size", type=int, help=f"prompt ids below this (default: the model's; --url: {URL_VOCAB})")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds, per request")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds for the cluster to start")
    ap.add_argument("--schema", help="then the same load with this JSON schema as response_format: medium or a file")
    ap.add_argument("--keep-logs", type=Path, metavar="DIR",
                    help="copy the started cluster's logs here once it is stopped (e.g. $OUT on the GPU machine)")
    args = ap.parse_args(argv)
    if args.rate is None and args.concurrency is None:
        args.concurrency = 4
    lo, _, hi = args.prompt_len.partition(":")
    if not (lo.isdigit() and (not hi or hi.isdigit()) and 0 < int(lo) <= int(hi or lo)):
        ap.error(f"--prompt-len must be N or LO:HI with 0 < LO <= HI, got {args.prompt_len!r}")
    for name in ("concurrency", "rate", "requests", "max_tokens"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    # SIGTERM ends us like Ctrl-C does, so a cluster started here is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with cluster(args) as target:
        result = asyncio.run(bench(target, args))
    print_table(result)
    if "structured" in result:
        print(f"\nwith response_format json_schema ({result['schema']}):")
        print_table(result["structured"])
        print(f"TPOT p50 with the schema / without: {result['structured_tpot_p50_ratio']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
