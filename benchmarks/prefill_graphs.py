"""Short prefills as one CUDA-graph replay of token rows against eager prefill, side by side.

  python3 benchmarks/prefill_graphs.py            # V2-Lite's shape on dummy weights, bf16, one GPU

One engine (``enable_prefix_caching`` on), one request at a time, each to its first token
(synchronized before and after). Each case runs eagerly and as a replay interleaved
(``engine.model_runner.GRAPH_PREFILL_MAX_KEYS`` 0 and unlimited), each time with fresh tokens of a
slightly different length (n, n - 1, ...) (what serving sees: eager pays for shapes it has not seen):

- prompts of 16 to 512 new tokens, nothing cached (and again at one length each: "seen", the
  best case for eager);
- a cached prefix of 496 to 16,384 tokens followed by a user turn of 16 to 500 new tokens.

It prints the median time per case and form, and eager / graph, then one JSON line. The crossover
(where a prefill row's own pass over its context costs more than eager's one decompression per
request) sets ``GRAPH_PREFILL_MAX_KEYS``.
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

from prefill_host import first_token_ms  # noqa: E402
from presets import V2_LITE  # noqa: E402

from engine import model_runner  # noqa: E402
from engine.engine_config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

FORMS = {"eager": 0, "graph": 1 << 62}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each case and form")
    ap.add_argument("--new", type=int, nargs="+", default=[16, 64, 128, 256, 512])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[496, 2048, 8192, 16384])
    ap.add_argument("--turns", type=int, nargs="+", default=[16, 200, 500], help="new tokens after a prefix")
    args = ap.parse_args()
    model = Path(tempfile.mkdtemp()) / "v2-lite"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(V2_LITE))
    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=32768,
                                 max_num_batched_tokens=32768, load_format="dummy", device=args.device,
                                 gpu_memory_utilization=0.5))
    start_s = time.perf_counter() - t0
    graphs = eng.executor.graphs
    assert graphs is not None and graphs.max_rows >= max([*args.new, *args.turns]), "no graphs for these sizes"
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def ttft(prompt: list[int], form: str) -> float:
        model_runner.GRAPH_PREFILL_MAX_KEYS = FORMS[form]
        before = graphs.prefill_replays
        took = first_token_ms(eng, prompt, params)
        replayed = graphs.prefill_replays > before
        assert replayed == (form == "graph"), f"a {form} prefill of {len(prompt)} tokens replayed: {replayed}"
        return took

    def fresh(n: int) -> list[int]:
        return [rng.randrange(2, V2_LITE["vocab_size"]) for _ in range(n)]

    for form in FORMS:  # start-up work (first kernels, allocator)
        for _ in range(3):
            ttft(fresh(300), form)
    cases: dict[str, dict[str, list[float]]] = {}
    for n in args.new:
        runs = cases.setdefault(f"0+{n}", {f: [] for f in FORMS})
        for r in range(args.repeats):
            for form in FORMS:
                runs[form].append(ttft(fresh(n - r), form))
    for n in args.new:  # the same length again and again: eager's shapes all seen before
        runs = cases.setdefault(f"0+{n} seen", {f: [] for f in FORMS})
        ttft(fresh(n), "eager")
        for _ in range(args.repeats):
            for form in FORMS:
                runs[form].append(ttft(fresh(n), form))
    for p in args.prefixes:
        prefix = fresh(p)
        ttft(prefix + fresh(8), "eager")  # cached from here on
        for m in args.turns:
            runs = cases.setdefault(f"{p}+{m}", {f: [] for f in FORMS})
            for r in range(args.repeats):
                for form in FORMS:
                    runs[form].append(ttft(prefix + fresh(m - r), form))
    med = {c: {f: round(statistics.median(v), 2) for f, v in runs.items()} for c, runs in cases.items()}
    print(f"engine start-up {start_s:.1f}s, graphs up to {graphs.max_rows} rows")
    print(f"{'cached+new':>14} {'eager ms':>9} {'graph ms':>9} {'eager/graph':>11}")
    for c, m in med.items():
        print(f"{c:>14} {m['eager']:9.2f} {m['graph']:9.2f} {m['eager'] / m['graph']:11.2f}")
    print(json.dumps({"benchmark": "prefill_graphs", "device": torch.cuda.get_device_name(), "start_s": start_s,
                      "max_rows": graphs.max_rows, "median_ms": med,
                      "eager_over_graph": {c: round(m["eager"] / m["graph"], 3) for c, m in med.items()},
                      "runs_ms": cases}))


if __name__ == "__main__":
    main()
