"""The front end alone: our proxy against vllm-router on null engines, same load, interleaved runs.

  python benchmarks/proxy.py                      # concurrency 1, 32, 128; 3 repetitions of 3 s each
  python benchmarks/proxy.py --concurrency 1 32 --seconds 5 --repeats 5
  python benchmarks/proxy.py --workers 1 2        # our proxy with one and with two worker processes
  python benchmarks/proxy.py --baseline /tmp/base  # and the proxy of another tree (git worktree add /tmp/base REV)

Null engines (``benchmarks/null_engines.py``) answer at once, so what is measured is the front end:
for our proxy, a null prefill and a null decode node (grpc.aio, the real ``pdcluster.v1`` contract,
registered in a local Redis as nodes register) behind ``python -m proxy``; for vllm-router (``pip
install vllm-router``; its ``--vllm-pd-disaggregation`` mode, round robin), a null prefill and a
null decode vLLM HTTP server (aiohttp: the prefill answers ``max_tokens`` 1 with
``kv_transfer_params``, the decode streams). Each null node and server is a process of its own, as
real nodes are. Every request is a streamed ``/v1/completions`` of a
``--prompt-tokens`` token-id prompt for ``--max-tokens`` tokens from a closed-loop aiohttp client at
each concurrency. Both null decode engines make one token per turn of their event loop (``--pacing
turn``), so each token reaches the front end on its own as a real engine's do, however fast the
front end reads; ``--pacing step`` has them make one token for every stream per decode step of
``--step-ms`` (one clock per engine, as a real engine's batch steps: the front end then sees what it
sees in service, one token per stream per step, and has to keep up with many streams at once);
``--pacing burst`` has both write every token at once. Our null decode node steps one loop for its
whole batch (a token for every stream per turn or step, as a real engine's steps) and hands each
step's events to the calls as the decode node does (``decode_node.outbox.deliver`` into
``DecodeService``'s ``call_sink``); vllm-router's null decode server writes from each stream's
handler, as an aiohttp server does.
The runs interleave (repetition, then front end, then concurrency) and each figure is the median over
repetitions; the ratios between front ends come both as ratios of those medians and as the median of
each repetition's ratio (``paired_ratio_*``, steadier while the machine's speed drifts). Reported per
front end and concurrency: req/s, e2e / TTFT / ITL p50 and p99, the front
end's CPU time per request and its share of one core, the null engines' and the client's CPU per
request and the ceiling they leave (``ceiling_req_s``: the cores over their CPU per request, the rate
of a front end that cost nothing), and RSS (CPU is counted over the warm-up too, with its requests);
at concurrency 1 also the latency it
adds over calling the two null legs directly (the same client code, no front end; 200 such calls in
every repetition, pooled). Everything runs on
this machine's cores (the client, the null engines and the front end). Both front ends log at warning
level (no line per request: uvicorn's access log alone was 10% of our proxy's CPU per request). The
last line is one JSON object. Without vllm-router installed only our proxy is measured (the JSON says so).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from null_engines import MODEL, Pacer, serve_null_grpc, serve_null_http  # noqa: E402

from cluster.net import free_port  # noqa: E402


# -- the client --------------------------------------------------------------------------------------
@dataclass
class Run:
    e2e: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    warmup: float = 0.0
    completed: int = 0  # requests finished, the warm-up's included (the CPU figures cover it too)


async def stream_once(session: aiohttp.ClientSession, url: str, body: dict, run: Run | None) -> int:
    """One streamed request; records e2e, TTFT and ITL; returns the number of data events with text."""
    t0 = time.perf_counter()
    first = last = None
    events = 0
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url} answered {r.status}: {(await r.text())[:200]}")
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                frame, buf = buf.split(b"\n\n", 1)
                if not frame.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now
                elif run is not None and last is not None:
                    run.itl.append(now - last)
                last = now
                events += 1
    if run is not None and first is not None:
        run.ttft.append(first - t0)
        run.e2e.append(time.perf_counter() - t0)
    return events


def load_process(url: str, concurrency: int, seconds: float, warmup_s: float, body_file: str) -> None:
    """One client process of several (``--clients``): its closed loop, its samples as JSON on stdout."""
    body = json.loads(Path(body_file).read_text())

    async def go() -> Run:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
            return await closed_loop(lambda r: stream_once(s, url, body, r), concurrency, seconds, warmup_s)

    run = asyncio.run(go())
    print(json.dumps({"e2e": run.e2e, "ttft": run.ttft, "itl": run.itl, "errors": run.errors,
                      "completed": run.completed}))


async def closed_loop_processes(url: str, concurrency: int, seconds: float, warmup_s: float, body_file: Path,
                                clients: int) -> Run:
    """The closed loop at ``concurrency`` from ``clients`` processes (so the client is not what limits a
    front end on a machine of many cores), their samples pooled."""
    shares = [concurrency // clients + (i < concurrency % clients) for i in range(clients)]
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--load", url, str(n), str(seconds), str(warmup_s), str(body_file),
        stdout=asyncio.subprocess.PIPE) for n in shares if n]
    run = Run(seconds=seconds, warmup=warmup_s)
    for p in procs:
        out, _ = await p.communicate()
        part = json.loads(out)
        run.e2e += part["e2e"]
        run.ttft += part["ttft"]
        run.itl += part["itl"]
        run.errors += part["errors"]
        run.completed += part["completed"]
    return run


async def closed_loop(fn: Callable[[Run | None], Any], concurrency: int, seconds: float, warmup_s: float) -> Run:
    run = Run()
    stop_warm = time.perf_counter() + warmup_s
    end = stop_warm + seconds

    async def worker() -> None:
        while time.perf_counter() < end:
            measured = time.perf_counter() >= stop_warm
            try:
                await fn(run if measured else None)
                run.completed += 1
            except Exception:  # counted; the load goes on
                if measured:
                    run.errors += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    run.seconds, run.warmup = seconds, warmup_s
    return run


def body_for(args: argparse.Namespace) -> dict:
    return {"model": MODEL, "prompt": [(i * 7) % 900 + 10 for i in range(args.prompt_tokens)],
            "max_tokens": args.max_tokens, "stream": True, "temperature": 0, "ignore_eos": True}


async def direct_grpc(ports: dict, args: argparse.Namespace, n: int) -> Run:
    """The two null legs called directly (our nodes' gRPC, over the multiplexed streams the proxy
    uses: ``proxy.link.mux_client``), at concurrency 1."""
    import grpc

    from cluster import mux_wire
    from cluster.proto_gen import pdcluster_v1_pb2 as pb
    from proxy.link import mux_client

    prompt = body_for(args)["prompt"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['prefill']}") as pc, \
            grpc.aio.insecure_channel(f"127.0.0.1:{ports['decode']}") as dc:
        prefill = mux_client.MuxStream(pc, mux_wire.PREFILL)
        decode = mux_client.MuxStream(dc, mux_wire.DECODE)
        sampling = pb.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        run = Run()
        for k in range(n + 5):
            t0 = time.perf_counter()
            reply = await mux_client.prefill(prefill, pb.PrefillRequest(request_id=f"d{k}", token_ids=prompt,
                                                                         sampling=sampling), 10.0)
            first = time.perf_counter()
            call = mux_client.DecodeCall(decode, pb.DecodeRequest(request_id=f"d{k}", prompt_token_ids=prompt,
                                                                  sampling=sampling, first_token=reply.first_token,
                                                                  kv=reply.kv))
            while await call.read(10.0) is not grpc.aio.EOF:
                pass
            if k >= 5:
                run.ttft.append(first - t0)
                run.e2e.append(time.perf_counter() - t0)
        prefill.close()
        decode.close()
        return run


async def direct_http(prefill_url: str, decode_url: str, args: argparse.Namespace, n: int) -> Run:
    """The two null vLLM legs called directly (as vllm-router calls them), at concurrency 1."""
    body = body_for(args)
    run = Run()
    async with aiohttp.ClientSession() as s:
        for k in range(n + 5):
            t0 = time.perf_counter()
            async with s.post(prefill_url, json={**body, "stream": False, "max_tokens": 1}) as r:
                kv = (await r.json())["kv_transfer_params"]
            first = time.perf_counter()
            await stream_once(s, decode_url, {**body, "kv_transfer_params": kv}, None)
            if k >= 5:
                run.ttft.append(first - t0)
                run.e2e.append(time.perf_counter() - t0)
    return run


# -- the benchmark -----------------------------------------------------------------------------------
def wait_http(url: str, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:g}s")


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) * 1e3 if xs else None


def summarize(run: Run, cpu_s: float, engines_s: float, client_s: float) -> dict:
    """A run's figures. CPU per request: the front end's (``cpu_ms_per_req``), its null engines' and the
    client's; ``ceiling_req_s`` is the rate a front end costing nothing would reach on this machine's
    cores with these engines and this client (cores over their CPU per request)."""
    n, done = len(run.e2e), run.completed  # measured; all, over the same time as the CPU figures

    def per_req(s: float) -> float | None:
        return s / done * 1e3 if done else None
    rest = engines_s + client_s
    return {"req_s": n / run.seconds, "requests": n, "errors": run.errors,
            "e2e_p50_ms": pct(run.e2e, 50), "e2e_p99_ms": pct(run.e2e, 99),
            "ttft_p50_ms": pct(run.ttft, 50), "ttft_p99_ms": pct(run.ttft, 99),
            "itl_p50_ms": pct(run.itl, 50), "itl_p99_ms": pct(run.itl, 99),
            "cpu_ms_per_req": per_req(cpu_s), "cpu_share": cpu_s / (run.seconds + run.warmup),
            "engines_cpu_ms_per_req": per_req(engines_s), "client_cpu_ms_per_req": per_req(client_s),
            "ceiling_req_s": (os.cpu_count() or 1) * done / rest if done and rest > 0 else None}


def tree_rss(proc: psutil.Process) -> int:
    """RSS of a front end and its worker processes, summed (shared pages counted in each)."""
    total = proc.memory_info().rss
    for c in proc.children(recursive=True):
        try:
            total += c.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    own = t.user + t.system
    for c in proc.children(recursive=True):
        try:
            ct = c.cpu_times()
            own += ct.user + ct.system
        except psutil.NoSuchProcess:
            pass
    return own


def own_cpu_seconds() -> float:
    """This process's CPU (the client, when it runs here) and its finished children's (client processes)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def median_of(reps: list[dict]) -> dict:
    out = {}
    for k in reps[0]:
        vals = [r[k] for r in reps if r[k] is not None]
        out[k] = round(statistics.median(vals), 3) if vals else None
    return out


def paired_ratio(ours: list[dict], theirs: list[dict]) -> float | None:
    """The median over repetitions of our req/s over theirs in the same repetition. Each repetition runs
    the front ends back to back, and this machine's speed drifts between repetitions (by up to a fifth
    within one run, docs/benchmarks.md): a ratio of medians taken from different repetitions moves
    with that drift, a ratio within one repetition much less."""
    ratios = [o["req_s"] / t["req_s"] for o, t in zip(ours, theirs) if o["req_s"] and t["req_s"]]
    return round(statistics.median(ratios), 3) if ratios else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--seconds", type=float, default=3.0, help="measured seconds of each run")
    ap.add_argument("--warmup", type=float, default=0.5, help="seconds of load before each run's measurement")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--router", default=shutil.which("vllm-router") or "", help="vllm-router's binary ('' = skip)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1],
                    help="our proxy with each of these worker counts (one front end each)")
    ap.add_argument("--proxy-args", default="", help="extra flags for python -m proxy")
    ap.add_argument("--baseline", default="", metavar="DIR",
                    help="also the proxy of this source tree (--baseline-workers), front end 'baseline' (before/after "
                         "in one run), on null nodes of that tree (so a change to the nodes' side shows too)")
    ap.add_argument("--baseline-workers", type=int, default=1, help="worker processes of the --baseline proxy")
    ap.add_argument("--step-ms", type=float, default=5.0, help="--pacing step: the null engines' decode step")
    ap.add_argument("--pacing", choices=("turn", "step", "burst"), default="turn",
                    help="both null decode engines make one token per turn of their event loop (turn: each "
                         "token reaches the front end on its own, as a real engine's do), one per stream per "
                         "--step-ms step of one clock (step: as a real engine's batch steps), or all at once (burst)")
    ap.add_argument("--clients", type=int, default=1,
                    help="client processes sharing each run's concurrency (1: the client runs in this process)")
    ap.add_argument("--null-nodes", type=int, default=1,
                    help="null prefill and decode pairs behind each front end (ours: a prefill and a decode node, "
                         "vllm-router's: a prefill and a decode server; each a process)")
    ap.add_argument("--null-grpc", nargs=4, metavar=("REDIS", "CLUSTER", "LEN", "ROLE"), help=argparse.SUPPRESS)
    ap.add_argument("--null-index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--load", nargs=5, metavar=("URL", "CONC", "SECONDS", "WARMUP", "BODY"), help=argparse.SUPPRESS)
    ap.add_argument("--null-http", nargs=2, metavar=("ROLE", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.null_grpc:
        serve_null_grpc(args.null_grpc[0], args.null_grpc[1], int(args.null_grpc[2]),
                        Pacer(args.pacing, args.step_ms / 1000), args.null_grpc[3], args.null_index)
        return
    if args.load:
        load_process(args.load[0], int(args.load[1]), float(args.load[2]), float(args.load[3]), args.load[4])
        return
    if args.null_http:
        serve_null_http(args.null_http[0], int(args.null_http[1]), Pacer(args.pacing, args.step_ms / 1000))
        return

    from pdctl.redis_server import start_redis
    from pdctl.tiny_model import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="pdproxybench-"))
    model = make_tiny_model(tmp / MODEL)
    procs: list[subprocess.Popen] = []
    env = dict(os.environ)
    extra_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]  # kept after the tree's root

    def spawn(argv: list[str], tree: Path = ROOT, **kw: Any) -> subprocess.Popen:
        path = os.pathsep.join([str(tree), *extra_path])
        p = subprocess.Popen(argv, env={**env, "PYTHONPATH": path}, cwd=tree, start_new_session=True, **kw)
        procs.append(p)
        return p

    redis = start_redis(data_dir=tmp / "redis")
    fronts: dict[str, tuple[str, psutil.Process]] = {}
    result: dict[str, Any] = {"bench": "proxy", "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                              "seconds": args.seconds, "repeats": args.repeats, "cores": os.cpu_count(),
                              "clients": args.clients, "null_nodes": args.null_nodes,
                              "pacing": args.pacing, "step_ms": args.step_ms if args.pacing == "step" else None}
    try:
        def null_nodes(tree: Path, cluster: str) -> tuple[list[psutil.Process], dict[str, int]]:
            """The tree's null gRPC nodes, registered as ``cluster``; and the first of each role's port
            (the direct legs' nodes)."""
            nulls = [spawn([sys.executable, str(tree / "benchmarks" / "proxy.py"), "--null-grpc", redis.url, cluster,
                            "4096", role, "--pacing", args.pacing, "--step-ms", str(args.step_ms), "--null-index",
                            str(i)], tree=tree, stdout=subprocess.PIPE)
                     for i in range(args.null_nodes) for role in ("prefill", "decode")]
            first: dict[str, int] = {}
            for n in reversed(nulls):
                assert n.stdout is not None
                first.update(json.loads(n.stdout.readline()))
            return [psutil.Process(n.pid) for n in nulls], first

        def nodes_of(front: str) -> str:
            """Which null nodes serve the front end: vllm-router's, the baseline tree's, or ours."""
            return front if front in ("vllm-router", "baseline") else "ours"

        engines: dict[str, list[psutil.Process]] = {"vllm-router": []}
        ports: dict[str, dict[str, int]] = {}  # of each cluster of null nodes
        engines["ours"], ports["ours"] = null_nodes(ROOT, "bench")
        ours = [("pdcluster" if w == 1 else f"pdcluster-w{w}", w, ROOT) for w in args.workers]
        if args.baseline:  # its own null nodes: a change to the nodes' side is measured too
            base = Path(args.baseline).resolve()
            ours.append(("baseline", args.baseline_workers, base))
            engines["baseline"], ports["baseline"] = null_nodes(base, "bench-baseline")
        for name, workers, tree in ours:  # one proxy per worker count (and tree), each tree on its null nodes
            port = free_port("127.0.0.1")
            cluster = "bench-baseline" if name == "baseline" else "bench"
            proxy = spawn([sys.executable, "-m", "proxy", "--model", str(model), "--port", str(port),
                           "--registry-url", redis.url, "--cluster", cluster, "--workers", str(workers),
                           "--log-level", "warning", *args.proxy_args.split()],  # as vllm-router's, below
                          tree=tree, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{name}.log", "wb"))  # noqa: SIM115
            wait_http(f"http://127.0.0.1:{port}/health")
            fronts[name] = (f"http://127.0.0.1:{port}/v1/completions", psutil.Process(proxy.pid))
        if args.router:
            http_ports = {role: [free_port("127.0.0.1") for _ in range(args.null_nodes)]
                          for role in ("prefill", "decode")}
            hp, hd, rp = http_ports["prefill"][0], http_ports["decode"][0], free_port("127.0.0.1")
            for role, role_ports in http_ports.items():
                for http_port in role_ports:
                    engines["vllm-router"].append(psutil.Process(spawn(
                        [sys.executable, __file__, "--null-http", role, str(http_port), "--pacing", args.pacing,
                         "--step-ms", str(args.step_ms)]).pid))
            for http_port in http_ports["prefill"] + http_ports["decode"]:
                wait_http(f"http://127.0.0.1:{http_port}/health")
            servers = [a for role in ("prefill", "decode") for p in http_ports[role]
                       for a in (f"--{role}", f"http://127.0.0.1:{p}")]
            router = spawn([args.router, "--host", "127.0.0.1", "--port", str(rp), "--vllm-pd-disaggregation",
                            *servers, "--policy", "round_robin", "--log-level", "warning",
                            "--prometheus-port", str(free_port("127.0.0.1"))],
                           stdout=subprocess.DEVNULL, stderr=open(tmp / "router.log", "wb"))  # noqa: SIM115
            wait_http(f"http://127.0.0.1:{rp}/health")
            fronts["vllm-router"] = (f"http://127.0.0.1:{rp}/v1/completions", psutil.Process(router.pid))
        result["router"] = "vllm-router 0.1.17" if args.router else None
        body = body_for(args)
        body_file = tmp / "body.json"
        body_file.write_text(json.dumps(body))

        async def measure() -> dict:
            per: dict[str, dict[int, list[dict]]] = {f: {c: [] for c in args.concurrency} for f in fronts}
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
                names = list(fronts)
                legs = {nodes: Run() for nodes in ports}  # the direct legs, pooled over the repetitions
                http_legs = Run()

                async def call_legs(n: int) -> None:
                    for nodes, run in legs.items():
                        run.e2e.extend((await direct_grpc(ports[nodes], args, n)).e2e)
                    if "vllm-router" in fronts:
                        http_legs.e2e.extend((await direct_http(f"http://127.0.0.1:{hp}/v1/completions",
                                                                f"http://127.0.0.1:{hd}/v1/completions", args,
                                                                n)).e2e)

                for rep in range(args.repeats):
                    # The legs called directly, in every repetition (the reference of the added latency:
                    # measured once at the end it moved by ±0.3 ms between runs on 2 shared cores).
                    if 1 in args.concurrency:
                        await call_legs(200)
                    # Each repetition starts with the next front end (order effects cancel). Two identical
                    # trees still measured 0.91x for this tree's slot: compare trees both ways round.
                    for name in names[rep % len(names):] + names[:rep % len(names)]:
                        url, proc = fronts[name]
                        nulls_of = engines[nodes_of(name)]
                        for c in args.concurrency:
                            c0, e0, l0 = cpu_seconds(proc), sum(map(cpu_seconds, nulls_of)), own_cpu_seconds()
                            if args.clients > 1:
                                run = await closed_loop_processes(url, c, args.seconds, args.warmup, body_file,
                                                                  args.clients)
                            else:
                                run = await closed_loop(lambda r, url=url: stream_once(s, url, body, r), c,
                                                        args.seconds, args.warmup)
                            per[name][c].append(summarize(run, cpu_seconds(proc) - c0,
                                                          sum(map(cpu_seconds, nulls_of)) - e0,
                                                          own_cpu_seconds() - l0))
                            print(f"rep {rep} {name:>11} conc {c:>3}: {per[name][c][-1]['req_s']:7.1f} req/s",
                                  flush=True)
                if 1 not in args.concurrency:
                    await call_legs(100)
            direct = {name: http_legs if name == "vllm-router" else legs[nodes_of(name)] for name in fronts}
            return {"per": per, "direct": direct}

        m = asyncio.run(measure())
        for name, (_, proc) in fronts.items():
            res: dict[str, Any] = {"rss_mib": round(tree_rss(proc) / 2**20, 1)}
            for c in args.concurrency:
                res[f"c{c}"] = median_of(m["per"][name][c])
            d = m["direct"][name]
            res["direct_e2e_p50_ms"], res["direct_e2e_p99_ms"] = pct(d.e2e, 50), pct(d.e2e, 99)
            if 1 in args.concurrency:
                res["added_p50_ms"] = round(res["c1"]["e2e_p50_ms"] - res["direct_e2e_p50_ms"], 3)
                res["added_p99_ms"] = round(res["c1"]["e2e_p99_ms"] - res["direct_e2e_p99_ms"], 3)
            result[name] = res
        print_table(result, fronts, args.concurrency)
        pairs = []  # (key, ours, theirs): ratios of medians, and the median of each repetition's ratio
        same = "pdcluster" if args.baseline_workers == 1 else f"pdcluster-w{args.baseline_workers}"
        if "baseline" in fronts and same in fronts:  # this tree's proxy against the other's, as many workers
            pairs.append(("ratio_req_s_vs_baseline", same, "baseline"))
        if "vllm-router" in fronts:  # each of ours against vllm-router, per concurrency
            pairs += [("ratio_req_s" if name == "pdcluster" else f"ratio_req_s_{name.split('-')[-1]}", name,
                       "vllm-router") for name in fronts if name not in ("vllm-router", "baseline")]
        for key, ours, theirs in pairs:
            result[key] = {f"c{c}": round(result[ours][f"c{c}"]["req_s"] / result[theirs][f"c{c}"]["req_s"], 3)
                           for c in args.concurrency}
            paired = {f"c{c}": paired_ratio(m["per"][ours][c], m["per"][theirs][c]) for c in args.concurrency}
            result["paired_" + key] = paired
            print(f"{ours} / {theirs}, median of each repetition's req/s ratio: "
                  + ", ".join(f"{v} at concurrency {k[1:]}" for k, v in paired.items()))
    finally:
        for p in reversed(procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))


def print_table(result: dict, fronts: dict, concurrency: list[int]) -> None:
    print(f"\n{'front end':>12} {'conc':>5} {'req/s':>8} {'e2e p50':>9} {'e2e p99':>9} {'TTFT p50':>9} "
          f"{'ITL p50':>8} {'CPU/req':>8} {'CPU':>6} {'engines':>8} {'client':>7} {'ceiling':>8}")
    for name in fronts:
        for c in concurrency:
            r = result[name][f"c{c}"]

            def f(v: float | None, w: int, d: int = 1) -> str:
                return f"{v:{w}.{d}f}" if v is not None and not math.isnan(v) else " " * (w - 1) + "-"
            print(f"{name:>12} {c:>5} {f(r['req_s'], 8)} {f(r['e2e_p50_ms'], 9, 2)} {f(r['e2e_p99_ms'], 9, 2)} "
                  f"{f(r['ttft_p50_ms'], 9, 2)} {f(r['itl_p50_ms'], 8, 3)} {f(r['cpu_ms_per_req'], 8, 2)} "
                  f"{f(r['cpu_share'] * 100, 5, 0)}% {f(r['engines_cpu_ms_per_req'], 8, 2)} "
                  f"{f(r['client_cpu_ms_per_req'], 7, 2)} {f(r['ceiling_req_s'], 8, 0)}")
        res = result[name]
        added = f", adds {res['added_p50_ms']:.2f} ms p50 / {res['added_p99_ms']:.2f} ms p99 over the direct legs" \
            if "added_p50_ms" in res else ""
        print(f"{name:>12}: RSS {res['rss_mib']} MiB{added}")


if __name__ == "__main__":
    main()
