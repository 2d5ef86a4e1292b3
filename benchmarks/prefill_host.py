"""Where a short prefill's time goes on a GPU: prompt length seen before or not, with a cached prefix or not.

  python3 benchmarks/prefill_host.py                 # V2-Lite's shape on dummy weights, bf16, one GPU

One engine (``enable_prefix_caching`` on), one request at a time, each to its first token
(synchronized before and after): time per prefill for

- lengths already seen (each length run once to warm it, then three times),
- lengths never seen before (each once: what serving sees, since prompt lengths vary),
- a cached prefix followed by a new user turn (prefix caching's hit path): 2,048 + ~200 tokens, and a
  496-token prefix + 16 (a repeated short prompt: a hit must not cost more than the miss), with the
  context attention of ``engine.mla.CONTEXT_ATTENTION`` "joint" and "split" interleaved,

and the host time of one ``F.linear`` at a new and at a seen row count. Every prefill runs eagerly
(short ones would otherwise replay a CUDA graph: ``benchmarks/prefill_graphs.py``). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
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

from engine import mla, model_runner  # noqa: E402
from engine.engine_config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def first_token_ms(eng: LLMEngine, prompt: list[int], params: SamplingParams) -> float:
    """Milliseconds from adding ``prompt`` to its (``max_tokens=1``) request's end, on an idle GPU engine."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    seq = eng.add_request(prompt, params)
    while not seq.is_finished:
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    model_runner.GRAPH_PREFILL_MAX_KEYS = 0  # the eager path (benchmarks/prefill_graphs.py sets replays beside it)
    model = Path(tempfile.mkdtemp()) / "v2-lite"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(V2_LITE))
    eng = LLMEngine(EngineConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=32768,
                                 max_num_batched_tokens=32768, load_format="dummy", device=args.device,
                                 gpu_memory_utilization=0.5))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def ttft(prompt: list[int]) -> float:
        return first_token_ms(eng, prompt, params)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(2, V2_LITE["vocab_size"]) for _ in range(n)]

    for _ in range(3):
        ttft(fresh(300))  # start-up work (first kernels, allocator)
    seen = {}
    for n in (64, 256, 512, 1024, 2048):
        ttft(fresh(n))
        seen[n] = statistics.median(ttft(fresh(n)) for _ in range(3))
    new = {n: ttft(fresh(n)) for n in (65, 257, 513, 1025, 2049, 67, 259, 515, 1027, 2051)}
    system, short = fresh(2048), fresh(496)
    ttft(system + fresh(150))  # the prefixes are cached from here on
    ttft(short + fresh(16))
    cached: dict[str, list[float]] = {"joint": [], "split": []}
    cached_short: dict[str, list[float]] = {"joint": [], "split": []}
    for n in (200, 201, 202, 203, 204, 205):
        for form in ("joint", "split"):
            mla.CONTEXT_ATTENTION = form
            cached[form].append(ttft(system + fresh(n)))
            cached_short[form].append(ttft(short + fresh(16)))
    mla.CONTEXT_ATTENTION = "joint"
    miss_512 = statistics.median(ttft(fresh(512)) for _ in range(3))

    w = torch.randn(2048, 2048, device=args.device, dtype=torch.bfloat16)

    def linear_host_us(m: int) -> float:
        x = torch.randn(m, 2048, device=args.device, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        took = time.perf_counter() - t0
        torch.cuda.synchronize()
        return took * 1e6

    linear = {m: (round(linear_host_us(m), 1), round(linear_host_us(m), 1)) for m in (3001, 3002, 3003)}
    print("prefill of a length seen before (ms, median of 3):", {n: round(v, 1) for n, v in seen.items()})
    print("prefill of a length never seen (ms):", {n: round(v, 1) for n, v in new.items()})
    for form in ("joint", "split"):
        print(f"context attention {form}: 2,048 cached + 200-205 new (ms):", [round(v, 1) for v in cached[form]],
              "; 496 cached + 16 new:", [round(v, 1) for v in cached_short[form]])
    print(f"512 tokens, nothing cached (ms, median of 3): {miss_512:.1f}")
    print("one F.linear's host time, new row count then again (us):", linear)
    med = {f: {"2048+200": statistics.median(cached[f]), "496+16": statistics.median(cached_short[f])}
           for f in cached}
    print(json.dumps({"benchmark": "prefill_host", "device": torch.cuda.get_device_name(), "seen_ms": seen,
                      "new_ms": new, "cached_prefix_ms": cached, "cached_short_ms": cached_short,
                      "cached_median_ms": med, "miss_512_ms": miss_512,
                      "joint_over_split": {k: round(med["joint"][k] / med["split"][k], 3) for k in med["joint"]},
                      "linear_host_us": linear}))


if __name__ == "__main__":
    main()
