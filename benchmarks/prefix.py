"""Prefix caching in the engine: a shared-prefix workload with ``enable_prefix_caching`` off and on.

  python benchmarks/prefix.py                         # tiny model on CPU (made on the fly)
  python benchmarks/prefix.py --preset v2-lite        # DeepSeek-V2-Lite-shaped random bf16 model on a GPU

Every request is a shared system prompt (``--system-tokens``, 2,048) and its own user turn (100–300
tokens, seeded), for ``--max-tokens`` greedy tokens, one request at a time (each one's time to first
token is its prefill: what a request sees on an idle engine). Both engines get the same requests in
one run; reported per setting: TTFT p50 / p99, prompt tokens computed, and with caching the hit rate
next to the ideal (the shared prompt's full blocks over every prompt's full blocks, the first request
missing). Greedy outputs must be equal. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from presets import V2_LITE  # noqa: E402

from engine.engine_config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def workload(n: int, system_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(2, vocab) for _ in range(system_tokens)]
    return [system + [rng.randrange(2, vocab) for _ in range(rng.randint(100, 300))] for _ in range(n)]


def serve_one_at_a_time(eng: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list]:
    """Each request alone: its TTFT (seconds to its first token) and its output ids."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    ttft, outs = [], []
    for p in prompts:
        sync()
        t0 = time.perf_counter()
        seq = eng.add_request(p, params)
        while not seq.output_token_ids:
            eng.step()
        ttft.append(time.perf_counter() - t0)
        while not seq.is_finished:
            eng.step()
        outs.append(list(seq.output_token_ids))
    return ttft, outs


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=["tiny", "v2-lite"], default="tiny")
    ap.add_argument("--device", default=None, help="default: cuda for v2-lite, cpu for tiny")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lse-kernel", choices=["cudnn", "flash"], default=None,
                    help="GPU: the fused attention kernel (engine.attention_ops.LSE_KERNEL; default: the engine's)")
    args = ap.parse_args()
    if args.lse_kernel:
        from engine import attention_ops

        attention_ops.LSE_KERNEL = args.lse_kernel

    tmp = Path(tempfile.mkdtemp(prefix="pdprefix-"))
    if args.preset == "tiny":
        from pdctl.tiny_model import make_tiny_model

        model_dir = make_tiny_model(tmp / "tiny", arch="v2", moe=True, seed=0)
        kw = dict(dtype="float32", max_model_len=4096, max_num_batched_tokens=4096, device=args.device or "cpu")
    else:
        model_dir = tmp / "v2-lite"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(V2_LITE))
        # 40% of the GPU each: the two engines are built one after the other in this process
        kw = dict(dtype="bfloat16", max_model_len=32768, max_num_batched_tokens=32768, load_format="dummy",
                  device=args.device or "cuda", gpu_memory_utilization=0.4)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = workload(args.requests, args.system_tokens, vocab, args.seed)
    from engine import attention_ops

    result: dict = {"bench": "prefix", "preset": args.preset, "requests": args.requests,
                    "lse_kernel": attention_ops.LSE_KERNEL,
                    "system_tokens": args.system_tokens, "prompt_tokens": sum(map(len, prompts))}
    outputs = {}
    for caching in (False, True):
        eng = LLMEngine(EngineConfig(model=str(model_dir), skip_tokenizer_init=True,
                                     enable_prefix_caching=caching, **kw))
        serve_one_at_a_time(eng, workload(2, 64, vocab, args.seed + 1), 2)  # warm up (other prompts)
        cache = eng.prefix_cache
        before = cache.hits if cache else 0
        queries = cache.queries if cache else 0
        ttft, outs = serve_one_at_a_time(eng, prompts, args.max_tokens)
        outputs[caching] = outs
        key = "caching" if caching else "no_caching"
        hit_blocks = (cache.hits - before) if cache else 0
        res = {"ttft_p50_ms": round(statistics.median(ttft) * 1e3, 2), "ttft_p99_ms": round(pct(ttft, 99) * 1e3, 2),
               "prompt_tokens_computed": result["prompt_tokens"] - hit_blocks * eng.config.block_size}
        if cache:
            bs = eng.config.block_size
            looked = cache.queries - queries
            ideal = (args.system_tokens // bs) * (args.requests - 1) / max(1, sum((len(p) - 1) // bs for p in prompts))
            res |= {"hit_rate": round(hit_blocks / max(1, looked), 4), "ideal_hit_rate": round(ideal, 4)}
        result[key] = res
        print(f"{key:>11}: TTFT p50 {res['ttft_p50_ms']:.1f} ms, p99 {res['ttft_p99_ms']:.1f} ms, "
              f"{res['prompt_tokens_computed']} prompt tokens computed"
              + (f", hit rate {res['hit_rate']:.1%} (ideal {res['ideal_hit_rate']:.1%})" if cache else ""), flush=True)
        eng.shutdown()
        del eng, cache
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result["outputs_equal"] = outputs[False] == outputs[True]
    result["ttft_p50_ratio"] = round(result["no_caching"]["ttft_p50_ms"] / result["caching"]["ttft_p50_ms"], 2)
    result["hit_rate_of_ideal"] = round(result["caching"]["hit_rate"] / result["caching"]["ideal_hit_rate"], 3)
    print(f"TTFT p50 {result['ttft_p50_ratio']}x lower with caching; hit rate {result['hit_rate_of_ideal']:.1%} of "
          f"the ideal; outputs equal: {result['outputs_equal']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
