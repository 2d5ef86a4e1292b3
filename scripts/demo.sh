#!/usr/bin/env bash
# Fresh machine -> the tiny model answering a chat request through the native engine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODEL=${MODEL:-models/tiny}
if [ ! -f "$MODEL/config.json" ]; then
  pdctl make-model "$MODEL" --seed 0
fi
python3 -m engine.chat --model "$MODEL" "${@:-What does a serving cluster do?}"
