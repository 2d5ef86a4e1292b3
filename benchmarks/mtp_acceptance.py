"""Speculative decoding with the MTP layer on a tiny model that has learned something: acceptance and speed.

Trains the tiny DeepSeek-V3-style model with its MTP layer on the tiny corpus (``pdctl make-model --train``;
or takes ``--model``), then decodes greedily from prompts cut from the corpus, in the engine (``LLM``) without
speculative decoding and with ``num_speculative_tokens`` k = 1..3, in one run:

- acceptance rate (accepted draft tokens over drafted) and mean accepted length (tokens a verify step gives:
  the accepted drafts and the target's own), vLLM's two figures, on prompts from the paragraphs trained on and
  from the held-out one;
- decode tokens per second against no drafts (the same prompts, one at a time: batch 1), as a ratio;
- that the outputs equal the no-draft outputs token for token.

With ``--cluster``, also through a whole local cluster (``pdctl up``'s launcher): a prefill node and a decode
node with ``num_speculative_tokens`` 1, beside a decode node without it (the baseline, fed by the same prefill
node, which it ignores the draft of); the same prompts one at a time through the proxy (streamed completions),
each decode node in turn (the other drained): decode tokens per second after the first token, as a ratio.

CPU figures are ratios of this machine's; the GPU's verify-step cost is ``benchmarks/mla_decode.py``'s matter.
Ends with one JSON line.

    python benchmarks/mtp_acceptance.py [--model DIR] [--train-steps 300] [--max-tokens 48] [--k 1 2 3] [--cluster]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402
from pdctl.tiny_model import make_tiny_model  # noqa: E402
from pdctl.train_tiny import corpus_ids, train_tiny_model  # noqa: E402

PROMPT_TOKENS = 24
KW = dict(dtype="float32", device="cpu", max_model_len=512)


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


def run(model: Path, batch: list[list[int]], max_tokens: int, k: int) -> dict:
    spec = {"speculative_config": json.dumps({"method": "mtp", "num_speculative_tokens": k})} if k else {}
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(str(model), **spec, **KW) as llm:
        llm.generate(batch[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        t0 = time.perf_counter()
        outs = [llm.generate([p], sp)[0].token_ids for p in batch]  # batch 1: one request at a time
        seconds = time.perf_counter() - t0
        c = llm.engine.spec_counts
        return {"k": k, "tokens_per_s": len(batch) * max_tokens / seconds, "outputs": outs,
                "acceptance_rate": c.acceptance_rate if k else None,
                "mean_accepted_length": c.mean_accepted_length if k else None}


def through_cluster(model: Path, batch: list[list[int]], max_tokens: int, repeat: int) -> dict:
    """Decode tokens/s after the first token through the proxy, decode-0 (MTP, k = 1) against decode-1 (none)."""
    import httpx

    from pdctl.launcher import down, up
    from pdctl.topology import Topology

    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 1})
    run_dir = Path(tempfile.mkdtemp(prefix="mtp-cluster-"))
    node = {"max_model_len": 512, "num_kv_blocks": 128}
    topo = Topology.from_dict({
        "model": str(model), "served_model_name": "tiny", "registry": {"cluster": f"mtp-{run_dir.name}"},
        "proxy": {"port": 0}, "prefill": [{**node, "speculative_config": spec}],
        "decode": [{**node, "speculative_config": spec}, node]})
    state = up(topo, run_dir, timeout_s=300)
    speeds: dict[str, list[float]] = {"decode-0": [], "decode-1": []}
    texts: dict[str, list[str]] = {}
    try:
        with httpx.Client(base_url=state.proxy_url, timeout=120) as http:
            http.post("/v1/completions", json={"model": "tiny", "prompt": batch[0], "max_tokens": 4}).raise_for_status()
            for _ in range(repeat):  # rounds alternate the nodes (this machine's speed drifts); medians reported
                for node_id, other in (("decode-0", "decode-1"), ("decode-1", "decode-0")):
                    http.post(f"/admin/nodes/{other}/drain").raise_for_status()
                    http.post(f"/admin/nodes/{node_id}/undrain").raise_for_status()
                    time.sleep(1.5)  # the proxy's view refreshes
                    seconds, got = 0.0, []
                    for p in batch:
                        first = last = 0.0
                        text = []
                        with http.stream("POST", "/v1/completions", json={
                                "model": "tiny", "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as r:
                            r.raise_for_status()
                            for line in r.iter_lines():
                                if line.startswith("data: {"):
                                    last = time.perf_counter()
                                    first = first or last
                                    text.append(json.loads(line[6:])["choices"][0]["text"])
                        seconds += last - first
                        got.append("".join(text))
                    speeds[node_id].append(len(batch) * (max_tokens - 1) / seconds)
                    texts[node_id] = got
    finally:
        down(run_dir, grace_s=10)
    out = {n: {"tokens_per_s": statistics.median(v), "texts": texts[n]} for n, v in speeds.items()}
    assert out["decode-0"]["texts"] == out["decode-1"]["texts"], "the MTP decode node answered otherwise"
    ratio = out["decode-0"]["tokens_per_s"] / out["decode-1"]["tokens_per_s"]
    print(f"cluster, batch 1: {out['decode-0']['tokens_per_s']:.0f} decode tok/s with MTP (k=1) vs "
          f"{out['decode-1']['tokens_per_s']:.0f} without ({ratio:.2f}x, medians of {repeat}); answers equal")
    return {"mtp_tokens_per_s": round(out["decode-0"]["tokens_per_s"], 1),
            "baseline_tokens_per_s": round(out["decode-1"]["tokens_per_s"], 1), "speedup": round(ratio, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a model with an MTP layer (default: train one)")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=6, help="per set (trained-on, held-out)")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--repeat", type=int, default=3, help="rounds per configuration (the median is reported)")
    ap.add_argument("--cluster", action="store_true", help="also through a local cluster (trained-on prompts)")
    a = ap.parse_args()
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
                runs[k].append(run(model, batch, a.max_tokens, k))
        base_speed = statistics.median(r["tokens_per_s"] for r in runs[0])
        rows = []
        for k in a.k:
            r = runs[k][0]
            assert all(x["outputs"] == runs[0][0]["outputs"] for x in runs[k]), \
                f"k={k}: outputs differ from decoding without drafts"
            speed = statistics.median(x["tokens_per_s"] for x in runs[k])
            rows.append({"k": k, "acceptance_rate": round(r["acceptance_rate"], 3),
                         "mean_accepted_length": round(r["mean_accepted_length"], 2),
                         "speedup": round(speed / base_speed, 2)})
            print(f"{name:10} k={k}: acceptance {r['acceptance_rate']:.0%}, {r['mean_accepted_length']:.2f} "
                  f"tokens/step, {speed:.0f} tok/s vs {base_speed:.0f} without ({rows[-1]['speedup']:.2f}x, "
                  f"medians of {a.repeat}); outputs equal")
        results[name] = {"baseline_tokens_per_s": round(base_speed, 1), "k": rows}
    if a.cluster:
        results["cluster"] = through_cluster(model, prompts(model, False, a.prompts), a.max_tokens, a.repeat)
    print(json.dumps({"benchmark": "mtp_acceptance", "model": str(model), "trained": trained,
                      "max_tokens": a.max_tokens, "prompts_per_set": a.prompts, "batch": 1, "repeat": a.repeat,
                      **results}))


if __name__ == "__main__":
    main()
