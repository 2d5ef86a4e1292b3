"""Speculative decoding with the MTP layer on a tiny model that has learned something: acceptance and speed.

Trains the tiny DeepSeek-V3-style model with its MTP layer on the tiny corpus (``pdctl make-model --train``;
or takes ``--model``), then decodes greedily from prompts cut from the corpus, in the engine (``LLM``) without
speculative decoding and with ``num_speculative_tokens`` k = 1..3, in one run:

- acceptance rate (accepted draft tokens over drafted) and mean accepted length (tokens a verify step gives:
  the accepted drafts and the target's own), vLLM's two figures, on prompts from the paragraphs trained on and
  from the held-out one;
- decode tokens per second against no drafts (the same prompts, one at a time: batch 1), as a ratio;
- that the outputs equal the no-draft outputs token for token.

``--params`` adds sampling parameters to the measured requests (penalties, a grammar: how drafting holds up under
them); each row then also gives the decode steps the requests took with and without drafts.

With ``--cluster``, also through a whole local cluster (``pdctl up``'s launcher): a prefill node and a decode
node with ``num_speculative_tokens`` 1, beside a decode node without it (the baseline, fed by the same prefill
node, which it ignores the draft of); the same prompts through the proxy (streamed completions), one at a time
and ``--concurrency`` at a time, each decode node in turn (the other drained): decode tokens per second after
the first token, as a ratio, and the median TPOT. First a request of 3 tokens shows the decode node drafting on
its first step: its verify steps (``vllm:spec_decode_num_drafts``, read through the proxy's ``/admin/nodes``) go
up by one, which only the prefill node's handed-off draft allows (without it the first step decodes one token,
and the last token has no room for a draft).

``--device cuda`` runs the engines and the cluster's nodes on the GPU (bf16, CUDA graphs; the three nodes share
it). CPU figures are ratios of this machine's. Ends with one JSON line.

    python benchmarks/mtp_acceptance.py [--model DIR] [--train-steps 300] [--max-tokens 48] [--k 1 2 3] [--cluster]
    python benchmarks/mtp_acceptance.py --device cuda --repeat 1 --cluster --concurrency 1 16   # the GPU machine
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402
from engine.structured_output import StructuredOutputsParams  # noqa: E402
from pdctl.tiny_model import make_tiny_model  # noqa: E402
from pdctl.train_tiny import corpus_ids, train_tiny_model  # noqa: E402

PROMPT_TOKENS = 24
KW: dict[str, Any] = dict(dtype="float32", device="cpu", max_model_len=512)


def use_device(device: str) -> None:
    """Engines (and the cluster's nodes) on ``device``: fp32 on the CPU, bf16 with CUDA graphs on a GPU."""
    KW.update(device=device, dtype="float32" if device == "cpu" else "bfloat16")
    if device != "cpu":
        KW["gpu_memory_utilization"] = 0.15


def prompts(model: Path, held_out: bool, count: int) -> list[list[int]]:
    """``count`` prompts of PROMPT_TOKENS cut from the corpus's paragraphs (trained on, or held out)."""
    paragraphs = [p for p in corpus_ids(model, held_out) if len(p) > PROMPT_TOKENS + 8]
    out = []
    i = 0
    while len(out) < count:
        p = paragraphs[i % len(paragraphs)]
        start = (i // len(paragraphs)) * 7 % max(1, len(p) - PROMPT_TOKENS - 8)
        out.append(p[start : start + PROMPT_TOKENS])
        i += 1
    return out


def sampling(max_tokens: int, params: dict[str, Any]) -> SamplingParams:
    """Greedy, ``max_tokens`` each, with ``params`` (``--params``: penalties, a ``structured_outputs`` mapping...)."""
    extra: dict[str, Any] = dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True) | params
    if "structured_outputs" in extra:
        extra["structured_outputs"] = StructuredOutputsParams(**extra["structured_outputs"])
    return SamplingParams(**extra)


def run(model: Path, batch: list[list[int]], max_tokens: int, k: int, params: dict[str, Any]) -> dict:
    spec = {"speculative_config": json.dumps({"method": "mtp", "num_speculative_tokens": k})} if k else {}
    sp = sampling(max_tokens, params)
    with LLM(str(model), **spec, **KW) as llm:
        llm.generate(batch[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        before = llm.engine.spec_counts.accepted_tokens
        t0 = time.perf_counter()
        outs = [llm.generate([p], sp)[0].token_ids for p in batch]  # batch 1: one request at a time
        seconds = time.perf_counter() - t0
        c = llm.engine.spec_counts
        # every decode step (the first token is the prompt's) gives one token and its accepted drafts
        steps = sum(len(o) - 1 for o in outs) - (c.accepted_tokens - before)
        return {"k": k, "tokens_per_s": sum(len(o) for o in outs) / seconds, "outputs": outs,
                "acceptance_rate": c.acceptance_rate if k else None,
                "mean_accepted_length": c.mean_accepted_length if k else None, "decode_steps": steps}


def through_cluster(model: Path, batch: list[list[int]], max_tokens: int, repeat: int,
                    concurrency: list[int]) -> dict:
    """Decode tokens/s after the first token (and TPOT) through the proxy at each concurrency, decode-0 (MTP, k = 1)
    against decode-1 (none); and whether decode-0 drafts on its first step."""
    import httpx

    from pdctl.launcher import down, up
    from pdctl.topology import Topology

    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 1})
    run_dir = Path(tempfile.mkdtemp(prefix="mtp-cluster-"))
    node: dict[str, Any] = {"max_model_len": 512, "num_kv_blocks": 128, "device": KW["device"], "dtype": KW["dtype"]}
    if KW["device"] != "cpu":
        node.update(num_kv_blocks=1024, gpu_memory_utilization=KW["gpu_memory_utilization"])
    topo = Topology.from_dict({
        "model": str(model), "served_model_name": "tiny", "registry": {"cluster": f"mtp-{run_dir.name}"},
        "proxy": {"port": 0}, "prefill": [{**node, "speculative_config": spec}],
        "decode": [{**node, "speculative_config": spec}, node]})
    state = up(topo, run_dir, timeout_s=300)
    speeds: dict[tuple[str, int], list[float]] = {}
    tpots: dict[tuple[str, int], list[float]] = {}
    texts: dict[str, list[str]] = {}
    accepted: dict[int, list[tuple[int, ...]]] = {}  # decode-0's (verify steps, draft tokens, accepted) per round
    first_step = None
    try:
        with httpx.Client(base_url=state.proxy_url, timeout=120) as http:
            http.post("/v1/completions", json={"model": "tiny", "prompt": batch[0], "max_tokens": 4}).raise_for_status()
            http.post("/admin/nodes/decode-1/drain").raise_for_status()
            first_step = drafts_on_first_step(http, batch[1])
            for _ in range(repeat):  # rounds alternate the nodes (this machine's speed drifts); medians reported
                for node_id, other in (("decode-0", "decode-1"), ("decode-1", "decode-0")):
                    http.post(f"/admin/nodes/{other}/drain").raise_for_status()
                    http.post(f"/admin/nodes/{node_id}/undrain").raise_for_status()
                    time.sleep(1.5)  # the proxy's view refreshes
                    for c in concurrency:
                        reqs = [batch[i % len(batch)] for i in range(max(c, len(batch)))]
                        before = _spec_counts(http, node_id)
                        with ThreadPoolExecutor(c) as pool:
                            done = list(pool.map(lambda p: _stream(http, p, max_tokens), reqs))
                        if node_id == "decode-0":
                            after = _settled_counts(http, node_id, before)
                            accepted.setdefault(c, []).append(tuple(a - b for a, b in zip(after, before)))
                        decode_s = [last - first for first, last, _ in done]
                        # each stream's decode rate after its first token (the requests' decode tokens over their
                        # decode seconds: the time before a stream's first token is not counted)
                        speeds.setdefault((node_id, c), []).append(len(reqs) * (max_tokens - 1) / sum(decode_s))
                        tpots.setdefault((node_id, c), []).append(
                            statistics.median(decode_s) / (max_tokens - 1) * 1e3)
                        if c == 1:
                            texts[node_id] = [text for _, _, text in done]
    finally:
        down(run_dir, grace_s=10)
    assert texts["decode-0"] == texts["decode-1"], "the MTP decode node answered otherwise"
    rows = []
    for c in concurrency:
        mtp, base = (statistics.median(speeds[(n, c)]) for n in ("decode-0", "decode-1"))
        t_mtp, t_base = (statistics.median(tpots[(n, c)]) for n in ("decode-0", "decode-1"))
        steps, drafted, ok = (sum(r[i] for r in accepted[c]) for i in range(3))
        rows.append({"concurrency": c, "mtp_stream_tokens_per_s": round(mtp, 1),
                     "baseline_stream_tokens_per_s": round(base, 1), "speedup": round(mtp / base, 2),
                     "mtp_tpot_ms": round(t_mtp, 2), "baseline_tpot_ms": round(t_base, 2),
                     "acceptance_rate": round(ok / drafted, 3) if drafted else None,
                     "mean_accepted_length": round(1 + ok / steps, 2) if steps else None})
        print(f"cluster, concurrency {c}: {mtp:.0f} decode tok/s per stream with MTP (k=1) vs {base:.0f} without "
              f"({mtp / base:.2f}x), TPOT {t_mtp:.2f} vs {t_base:.2f} ms (medians of {repeat}); decode-0's "
              f"acceptance {rows[-1]['acceptance_rate']}, {rows[-1]['mean_accepted_length']} tokens/verify step; "
              "answers equal")
    print(f"cluster: the MTP decode node drafted on its first step: {first_step}")
    return {"rows": rows, "drafts_on_first_step": first_step}


def _stream(http: Any, prompt: list[int], max_tokens: int) -> tuple[float, float, str]:
    """One streamed completion -> (first token's time, last token's time, text)."""
    first = last = 0.0
    text = []
    with http.stream("POST", "/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = time.perf_counter()
                first = first or last
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return first, last, "".join(text)


def _spec_counts(http: Any, node_id: str) -> tuple[int, int, int]:
    """A decode node's verify steps, draft tokens and accepted ones since start, as the proxy's ``/admin/nodes``
    reports its replicas' loads."""
    def find(x: Any, key: str) -> int:
        if isinstance(x, dict):
            return int(x.get(key) or 0) + sum(find(v, key) for k, v in x.items() if k != key)
        return sum(find(v, key) for v in x) if isinstance(x, list) else 0

    nodes = [n for n in http.get("/admin/nodes").json()["nodes"] if json.dumps(n).find(f'"{node_id}"') >= 0]
    return tuple(find(nodes, k) for k in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens"))  # type: ignore[return-value]


def _settled_counts(http: Any, node_id: str, before: tuple[int, int, int]) -> tuple[int, int, int]:
    """The node's counts once they differ from ``before`` (its loads reach the proxy with its next report)."""
    deadline = time.monotonic() + 10
    after = before
    while after == before and time.monotonic() < deadline:
        time.sleep(0.25)
        after = _spec_counts(http, node_id)
    return after


def drafts_on_first_step(http: Any, prompt: list[int]) -> bool:
    """Whether one request of 3 tokens adds exactly one verify step on decode-0 (the only decode node routed to):
    its first token comes from the prefill node, and only with the handed-off draft does its first decode step
    verify one (a decode step without it gives one token, after which the last token leaves no room to draft)."""
    time.sleep(1.5)
    before = _spec_counts(http, "decode-0")
    http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0,
                                       "ignore_eos": True}).raise_for_status()
    return _settled_counts(http, "decode-0", before)[0] - before[0] == 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a model with an MTP layer (default: train one)")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=6, help="per set (trained-on, held-out)")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--repeat", type=int, default=3, help="rounds per configuration (the median is reported)")
    ap.add_argument("--cluster", action="store_true", help="also through a local cluster (trained-on prompts)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1], help="with --cluster: requests at a time")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (bf16, CUDA graphs)")
    ap.add_argument("--params", type=json.loads, default={}, metavar="JSON",
                    help='more sampling parameters for the measured requests, e.g. \'{"repetition_penalty": 1.3}\' '
                         'or \'{"structured_outputs": {"regex": "[a-z ]+"}}\' (the engine alone, not --cluster)')
    a = ap.parse_args()
    use_device(a.device)
    model = a.model
    trained = None
    if model is None:
        model = make_tiny_model(Path(tempfile.mkdtemp(prefix="mtp-bench-")) / "tiny-mtp", arch="v3", moe=False,
                                mtp_layers=1)
        report = train_tiny_model(model, steps=a.train_steps)
        trained = {"steps": report.steps, "seconds": round(report.seconds, 1), "loss": round(report.loss, 3),
                   "mtp_loss": round(report.mtp_loss or 0.0, 3)}
        print(f"trained {model}: {trained}")
    results = {}
    for name, held_out in (("trained-on", False), ("held-out", True)):
        batch = prompts(model, held_out, a.prompts)
        # Rounds alternate the configurations (this machine's speed drifts); each figure is its rounds' median.
        runs: dict[int, list[dict]] = {k: [] for k in (0, *a.k)}
        for _ in range(a.repeat):
            for k in runs:
                runs[k].append(run(model, batch, a.max_tokens, k, a.params))
        base_speed = statistics.median(r["tokens_per_s"] for r in runs[0])
        rows = []
        for k in a.k:
            r = runs[k][0]
            assert all(x["outputs"] == runs[0][0]["outputs"] for x in runs[k]), \
                f"k={k}: outputs differ from decoding without drafts"
            speed = statistics.median(x["tokens_per_s"] for x in runs[k])
            rows.append({"k": k, "acceptance_rate": round(r["acceptance_rate"], 3),
                         "mean_accepted_length": round(r["mean_accepted_length"], 2),
                         "decode_steps": r["decode_steps"], "baseline_decode_steps": runs[0][0]["decode_steps"],
                         "speedup": round(speed / base_speed, 2)})
            print(f"{name:10} k={k}: acceptance {r['acceptance_rate']:.0%}, {r['mean_accepted_length']:.2f} "
                  f"tokens/verify step, {r['decode_steps']} decode steps vs {runs[0][0]['decode_steps']}, "
                  f"{speed:.0f} tok/s vs {base_speed:.0f} without ({rows[-1]['speedup']:.2f}x, "
                  f"medians of {a.repeat}); outputs equal")
        results[name] = {"baseline_tokens_per_s": round(base_speed, 1), "k": rows}
    if a.cluster:
        results["cluster"] = through_cluster(model, prompts(model, False, a.prompts), a.max_tokens, a.repeat,
                                             a.concurrency)
    print(json.dumps({"benchmark": "mtp_acceptance", "model": str(model), "trained": trained,
                      "device": a.device, "max_tokens": a.max_tokens, "prompts_per_set": a.prompts, "batch": 1,
                      "params": a.params,
                      "repeat": a.repeat,
                      **results}))


if __name__ == "__main__":
    main()
