#!/usr/bin/env bash
# Install pdcluster and everything it needs into the current Python (run as root or in a venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "== installing torch (CPU build where one is available)"
  "$PY" -m pip install -q "torch==2.13.0"
fi
echo "== installing pdcluster and its Python dependencies"
"$PY" -m pip install -q -e ".[dev]"
