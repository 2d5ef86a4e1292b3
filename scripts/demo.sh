#!/usr/bin/env bash
# Fresh machine -> a whole local cluster on the tiny model (redis, a PCP2 prefill node with sharded
# KV, a DP2 decode node, the OpenAI proxy) answering a chat request. The cluster keeps running.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODEL=${MODEL:-models/tiny}
PORT=${PORT:-8000}
RUN_DIR=${RUN_DIR:-$HOME/.pdcluster/demo}
if [ ! -f "$MODEL/config.json" ]; then
  pdctl make-model "$MODEL" --seed 0
fi
if ! pdctl status --run-dir "$RUN_DIR" >/dev/null 2>&1; then
  pdctl up --model "$MODEL" --served-model-name tiny --proxy-port "$PORT" \
    --prefill-pcp 2 --prefill-dp 1 --prefill-pp 1 --kv-layout sharded --decode-dp 2 --run-dir "$RUN_DIR"
fi
pdctl status --run-dir "$RUN_DIR"
URL=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['proxy_url'])" "$RUN_DIR/state.json")
python3 - "$URL" "${*:-What does a serving cluster do?}" <<'PY'
import sys, time, httpx
url, message = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
    "model": "tiny", "messages": [{"role": "user", "content": message}], "max_tokens": 32, "temperature": 0})
r.raise_for_status()
out = r.json()
print(f"user> {message}")
print(f"assistant> {out['choices'][0]['message']['content']}")
print(f"({out['usage']['prompt_tokens']} prompt tokens, {out['usage']['completion_tokens']} generated, "
      f"finish={out['choices'][0]['finish_reason']}, {time.perf_counter() - t0:.2f}s)")
PY
echo
echo "The cluster is still running: proxy $URL (OpenAI API), 'pdctl status --run-dir $RUN_DIR',"
echo "stop it with: pdctl down --run-dir $RUN_DIR"
