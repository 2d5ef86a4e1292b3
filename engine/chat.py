"""Chat with a model through the native engine, offline: ``python -m engine.chat --model DIR "message"``."""

from __future__ import annotations

import argparse
import time

from engine import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="model directory (Hugging Face format)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("message", nargs="+", help="the user message")
    args = ap.parse_args()
    t0 = time.perf_counter()
    try:
        llm = LLM(args.model, dtype=args.dtype, max_model_len=2048)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    with llm:
        tok = llm.get_tokenizer()
        prompt = tok.apply_chat_template([{"role": "user", "content": " ".join(args.message)}])
        out = llm.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))[0]
    print(f"user> {' '.join(args.message)}")
    print(f"assistant> {out.text}")
    print(f"({len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated, "
          f"finish={out.finish_reason}, {time.perf_counter() - t0:.1f}s)")


if __name__ == "__main__":
    main()
