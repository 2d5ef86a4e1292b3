"""What a speculative decoding step costs against a plain decode step, and the speedup that projects to.

A model of a published shape with one MTP layer and dummy weights (``--preset v2-lite``: DeepSeek-V2-Lite's
config plus ``num_nextn_predict_layers`` 1), or ``--model DIR``. For each batch size, ``batch`` requests of
``--prompt-len`` random tokens decode greedily:

- without speculative decoding, as users run it (CUDA graphs on a GPU);
- with ``num_speculative_tokens`` k = 1..3, also with graphs: each step verifies every request's k drafts
  (k + 1 rows, replayed from the graph of that many rows) and runs the MTP layer over them and once more per
  further draft (replayed from the MTP passes' graphs, ``engine.mtp_graphs``; ``--eager-passes`` adds the same
  step with those passes run eagerly, the engine before them). Dummy weights accept almost nothing, which
  does not change a step's cost (its rows are the same): the step time is what is measured. ``--eager`` adds
  both without graphs.

Projected tokens/s ratio at an acceptance rate a (drafts accepted independently, each with probability a):
a step gives ``(1 - a^(k+1)) / (1 - a)`` tokens, so ratio = that x decode step time / speculative step time.
Reported at DeepSeek's published 85% and at ``--acceptance`` (e.g. the trained tiny model's, from
``benchmarks/mtp_acceptance.py``), labelled as projections.

``--ceiling`` also times a plain decode step of (k + 1) x batch requests: the same rows through the
target, so the same weights read (under dummy weights' uniform routing, as many distinct experts), without
the MTP layer, the drafts' bookkeeping or the verdict. No speculative step can be shorter, so tokens a step
x decode step / that step bounds the projection from above. Ends with one JSON line.

    python benchmarks/mtp_verify.py --preset v2-lite --batch 1 8 64          # on the GPU machine
    python benchmarks/mtp_verify.py --tiny --device cpu --batch 1 4           # a check of the script on CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402
from engine.engine_config import EngineConfig  # noqa: E402
from pdctl.model_presets import PRESETS, preset_config  # noqa: E402
from pdctl.tiny_model import make_tiny_model, write_config_only  # noqa: E402

DEEPSEEK_ACCEPTANCE = 0.85  # DeepSeek-V3's report: 85-90% of second tokens accepted
# The engine's default, as a node runs: the step graphs up to it compute their rows' logits in the graph (an
# engine of max_num_seqs = 1 computes a 2-row verify step's logits eagerly after the replay).
MAX_NUM_SEQS = EngineConfig.max_num_seqs


def step_time(model: Path, device: str, batch: int, prompt_len: int, steps: int, k: int, eager: bool,
              dummy: bool, profile: bool = False, pass_graphs: bool = True, max_num_seqs: int = MAX_NUM_SEQS,
              kv_cache_dtype: str = "auto") -> float:
    """Seconds per engine step with ``batch`` requests decoding (k drafts each when k > 0; ``pass_graphs`` off:
    the MTP passes run eagerly after a replayed step) on an engine of ``max_num_seqs`` (at least ``batch``)."""
    kw: dict = dict(dtype="bfloat16" if device != "cpu" else "float32", device=device,
                    max_model_len=prompt_len + steps * (k + 1) + 64, max_num_seqs=max(batch, max_num_seqs),
                    max_num_batched_tokens=max(2048, prompt_len), enforce_eager=eager, kv_cache_dtype=kv_cache_dtype)
    if dummy:
        kw["load_format"] = "dummy"
    if k:
        kw["speculative_config"] = json.dumps({"method": "mtp", "num_speculative_tokens": k})
    with LLM(str(model), **kw) as llm:
        eng = llm.engine
        runner = eng.executor.runner
        if k and not eager:
            assert runner.mtp_graphs is not None or device == "cpu", "the MTP passes were not captured"
            if not pass_graphs:
                runner.mtp_graphs = None
        g = torch.Generator().manual_seed(1)
        seqs = [eng.add_request(torch.randint(10, 1000, (prompt_len,), generator=g).tolist(),
                                SamplingParams(max_tokens=steps * (k + 1) + 16, temperature=0.0, ignore_eos=True))
                for _ in range(batch)]
        while any(s.num_computed < len(s.prompt_token_ids) for s in seqs):
            eng.step()
        for _ in range(3):  # warm-up steps (the first verify steps among them)
            eng.step()
        assert not k or all(s.drafts for s in seqs), "every request drafts"
        sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        dt = (time.perf_counter() - t0) / steps
        if profile:  # where a step's time goes: host-side record_function spans and the GPU's kernels
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
            with torch_profile(activities=acts) as prof:
                for _ in range(5):
                    eng.step()
                sync()
            for key in ("cpu_time_total", "cuda_time_total") if device != "cpu" else ("cpu_time_total",):
                print(f"profile of 5 steps, batch {batch}, k={k}, by {key}:")
                print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))
        for s in seqs:
            eng.abort(s.request_id)
        return dt


def tokens_per_step(acceptance: float, k: int) -> float:
    return float(k + 1) if acceptance >= 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), help="a published shape with dummy weights")
    src.add_argument("--model", type=Path, help="a model directory with an MTP layer")
    src.add_argument("--tiny", action="store_true", help="the tiny random model (checks the script on CPU)")
    ap.add_argument("--layers", type=int, help="with --preset: this many decoder layers")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eager", action="store_true", help="also both steps without CUDA graphs")
    ap.add_argument("--eager-passes", action="store_true",
                    help="also the speculative step with graphs but its MTP passes run eagerly")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables of speculative steps")
    ap.add_argument("--ceiling", action="store_true",
                    help="also a plain decode step of (k+1) x batch requests: the bound on the projection")
    ap.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS,
                    help="the engine's max_num_seqs (at least the batch; earlier figures had the batch)")
    ap.add_argument("--acceptance", type=float, default=0.972,
                    help="another acceptance rate to project at (default: the trained tiny model's at k=1)")
    ap.add_argument("--quantization", choices=["none", "fp8"], default="none",
                    help="with --preset: fp8 declares DeepSeek's block FP8 in the config (FP8 experts on a GPU)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_ds_mla"], default="auto")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mtp-verify-"))
    dummy = a.preset is not None
    if a.preset:
        cfg = preset_config(a.preset, None if a.quantization == "none" else a.quantization, num_layers=a.layers)
        cfg["num_nextn_predict_layers"] = 1
        model = write_config_only(tmp / a.preset, cfg)
    elif a.model:
        model = a.model
    else:
        model = make_tiny_model(tmp / "tiny", arch="v3", seed=0, mtp_layers=1)
    rows = []
    for batch in a.batch:
        def timed(n: int) -> functools.partial[float]:  # steps of n requests on this model and settings
            return functools.partial(step_time, model, a.device, n, a.prompt_len, a.steps, dummy=dummy,
                                     max_num_seqs=a.max_num_seqs, kv_cache_dtype=a.kv_cache_dtype)

        run = timed(batch)
        base = run(0, eager=False)
        eager = run(0, eager=True) if a.eager else 0.0
        for k in a.k:
            spec = run(k, eager=False, profile=a.profile)
            passes = run(k, eager=False, pass_graphs=False) if a.eager_passes else 0.0
            spec_eager = run(k, eager=True) if a.eager else 0.0
            wide = timed(batch * (k + 1))(0, eager=False) if a.ceiling else 0.0
            row = {"batch": batch, "k": k, "decode_step_ms": round(base * 1e3, 3),
                   "eager_decode_step_ms": round(eager * 1e3, 3) or None, "spec_step_ms": round(spec * 1e3, 3),
                   "eager_spec_step_ms": round(spec_eager * 1e3, 3) or None,
                   "spec_step_eager_passes_ms": round(passes * 1e3, 3) or None,
                   "spec_over_decode": round(spec / base, 3),
                   "projected_speedup_at_85pct": round(tokens_per_step(DEEPSEEK_ACCEPTANCE, k) * base / spec, 2),
                   f"projected_speedup_at_{a.acceptance:g}": round(tokens_per_step(a.acceptance, k) * base / spec, 2),
                   "wide_decode_step_ms": round(wide * 1e3, 3) or None,
                   "ceiling_at_85pct":
                       round(tokens_per_step(DEEPSEEK_ACCEPTANCE, k) * base / wide, 2) if wide else None}
            rows.append(row)
            print(f"batch {batch:3} k={k}: spec step {spec * 1e3:.2f} ms vs decode {base * 1e3:.2f} ms "
                  f"(eager passes {passes * 1e3:.2f}; eager {eager * 1e3:.2f} / {spec_eager * 1e3:.2f}); "
                  f"projected {row['projected_speedup_at_85pct']:.2f}x at 85% "
                  f"acceptance (a projection)"
                  + (f"; decode of {batch * (k + 1)} requests {wide * 1e3:.2f} ms, ceiling "
                     f"{row['ceiling_at_85pct']:.2f}x" if wide else ""))
    print(json.dumps({"benchmark": "mtp_verify", "model": a.preset or str(model), "device": a.device,
                      "gpu": torch.cuda.get_device_name() if a.device != "cpu" and torch.cuda.is_available() else None,
                      "quantization": a.quantization, "kv_cache_dtype": a.kv_cache_dtype,
                      "prompt_len": a.prompt_len, "steps": a.steps, "max_num_seqs": a.max_num_seqs,
                      "rows": rows}))


if __name__ == "__main__":
    main()
