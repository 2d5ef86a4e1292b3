#!/usr/bin/env bash
# Benchmark clients nobody here wrote, against the CPU demo cluster: guidellm 0.8.1 and aiperf 0.13.0,
# each over /v1/chat/completions and /v1/responses (4 runs). Each run is short and closed-loop:
# CONCURRENCY streams, REQUESTS requests, 64-token synthetic prompts, 16-token answers (ignore_eos),
# streamed. Passes when every run completed requests and none failed, read from each tool's JSON.
#
#   bash benchmarks/clients.sh          # URL, MODEL, CONCURRENCY, REQUESTS, CLIENTS_VENV, OUT override
#
# The clients live in their own venv (CLIENTS_VENV), made on first use: they pin their own
# transformers, pydantic and torch, which must not replace the project's (guidellm pulls a CUDA torch
# from PyPI: the venv takes several GB). Without a proxy answering at URL, scripts/demo.sh starts the
# demo cluster, and it is stopped again at the end. Prints a table, then one JSON line.
set -euo pipefail
cd "$(dirname "$0")/.."
URL=${URL:-http://127.0.0.1:8000}
MODEL=${MODEL:-$PWD/models/tiny}  # the tokenizer both clients count tokens with
SERVED=${SERVED:-tiny}            # the demo's served model name
CONCURRENCY=${CONCURRENCY:-4}
REQUESTS=${REQUESTS:-32}
CLIENTS_VENV=${CLIENTS_VENV:-$HOME/.cache/pdcluster/clients-venv}
OUT=${OUT:-$(mktemp -d -t pdcluster-clients.XXXXXX)}
RUN_DIR=${RUN_DIR:-$HOME/.pdcluster/demo}
mkdir -p "$OUT"

if ! "$CLIENTS_VENV/bin/guidellm" --version 2>/dev/null | grep -q "0\.8\.1" \
    || [ "$("$CLIENTS_VENV/bin/aiperf" --version 2>/dev/null | tail -1)" != "0.13.0" ]; then
  echo "== installing guidellm 0.8.1 and aiperf 0.13.0 into $CLIENTS_VENV"
  python3 -m venv "$CLIENTS_VENV"
  "$CLIENTS_VENV/bin/pip" install -q "guidellm==0.8.1" "aiperf==0.13.0"
fi

up() { python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=5)" "$URL" 2>/dev/null; }
if ! up; then
  echo "== no proxy at $URL: starting the demo cluster (scripts/demo.sh)"
  PORT=${URL##*:} RUN_DIR=$RUN_DIR bash scripts/demo.sh >"$OUT/demo.log" 2>&1 || { tail -30 "$OUT/demo.log"; exit 1; }
  trap 'pdctl down --run-dir "$RUN_DIR" >/dev/null' EXIT
fi

run_guidellm() {  # $1: chat or responses; $2: the request format (endpoint path)
  echo "== guidellm $1 ($2)"
  "$CLIENTS_VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=$URL,model=$SERVED,request_format=$2" \
    --profile "kind=concurrent,streams=$CONCURRENCY" --constraint "kind=max_requests,count=$REQUESTS" \
    --tokenizer "kind=huggingface_auto,model=$MODEL" --data kind=synthetic_text,prompt_tokens=64,output_tokens=16 \
    --output "kind=json,path=$OUT/guidellm-$1.json" --disable-progress >"$OUT/guidellm-$1.log" 2>&1 \
    || echo "   guidellm exited with $? (log: $OUT/guidellm-$1.log)"
}

run_aiperf() {  # $1: chat or responses (aiperf's endpoint type)
  echo "== aiperf $1"
  # Server token counts: re-tokenizing the tiny model's random text on the client miscounts it.
  "$CLIENTS_VENV/bin/aiperf" profile --model "$SERVED" --url "$URL" --endpoint-type "$1" --streaming \
    --tokenizer "$MODEL" --isl 64 --osl 16 --extra-inputs ignore_eos:true --use-server-token-count \
    --concurrency "$CONCURRENCY" --request-count "$REQUESTS" --no-gpu-telemetry --ui none \
    --output-artifact-dir "$OUT/aiperf-$1" >"$OUT/aiperf-$1.log" 2>&1 \
    || echo "   aiperf exited with $? (log: $OUT/aiperf-$1.log)"
}

run_guidellm chat /v1/chat/completions
run_guidellm responses /v1/responses
run_aiperf chat
run_aiperf responses

python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])


def guidellm(path: Path) -> tuple[int, int]:
    totals = json.loads(path.read_text())["benchmarks"][0]["metrics"]["request_totals"]
    return totals["successful"], totals["errored"]


def aiperf(path: Path) -> tuple[int, int]:
    d = json.loads(path.read_text())
    errors = max((d.get("error_request_count") or {}).get("avg", 0), sum(e["count"] for e in d["error_summary"]))
    return int(d["request_count"]["avg"]), int(errors)  # request_count: the requests that succeeded


runs = []
for client, mode, path, read in [
        ("guidellm", "chat", out / "guidellm-chat.json", guidellm),
        ("guidellm", "responses", out / "guidellm-responses.json", guidellm),
        ("aiperf", "chat", out / "aiperf-chat" / "profile_export_aiperf.json", aiperf),
        ("aiperf", "responses", out / "aiperf-responses" / "profile_export_aiperf.json", aiperf)]:
    try:
        completed, errors = read(path)
    except (OSError, KeyError, IndexError, ValueError) as e:  # no output: the run failed outright
        print(f"{client} {mode}: no result in {path} ({type(e).__name__}: {e})")
        completed, errors = 0, None
    runs.append({"client": client, "mode": mode, "completed": completed, "errors": errors})

print(f"\n{'client':10} {'mode':10} {'completed':>9} {'errors':>6}")
for r in runs:
    print(f"{r['client']:10} {r['mode']:10} {r['completed']:>9} {str(r['errors']):>6}")
ok = all(r["completed"] > 0 and r["errors"] == 0 for r in runs)
print(f"outputs and logs: {out}")
print(json.dumps({"benchmark": "clients", "runs": runs, "ok": ok}))
sys.exit(0 if ok else 1)
PY
