#!/usr/bin/env bash
# Install pdcluster and everything it needs into the current Python (run as root or in a venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "== installing torch (CPU build where one is available)"
  "$PY" -m pip install -q "torch==2.13.0"
fi
if ! ldconfig -p 2>/dev/null | grep -q "libibverbs.so.1"; then
  echo "== installing libibverbs1 (Mooncake Transfer Engine loads it, even for tcp)"
  if command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get install -y -q libibverbs1 >/dev/null || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q libibverbs1 >/dev/null; }
  else
    echo "no apt-get: install libibverbs (rdma-core) with your package manager" >&2; exit 1
  fi
fi
if ! command -v docker-compose >/dev/null; then
  echo "== installing docker-compose (tests validate docker-compose.yml offline; no docker engine needed)"
  if command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get install -y -q docker-compose >/dev/null 2>&1 \
      || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q docker-compose >/dev/null 2>&1; } \
      || echo "warning: could not install docker-compose; tests/unit/test_compose.py will skip (fail under CI)" >&2
  else
    echo "warning: no apt-get: install docker-compose to validate docker-compose.yml" >&2
  fi
fi
if ! command -v ip >/dev/null; then
  echo "== installing iproute2 (tests/integration/test_multi_host_netns.py: network namespaces as separate hosts)"
  if command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get install -y -q iproute2 >/dev/null 2>&1 \
      || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q iproute2 >/dev/null 2>&1; } \
      || echo "warning: could not install iproute2; the namespace test will skip (fail under CI)" >&2
  else
    echo "warning: no apt-get: install iproute2 for the namespace test" >&2
  fi
fi
echo "== installing pdcluster and its Python dependencies"
"$PY" -m pip install -q -e ".[dev,transfer-cpu]"
