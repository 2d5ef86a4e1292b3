#!/usr/bin/env bash
# Install everything, lint, type-check, and run the default test suite (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff"
python3 -m ruff check .
echo "== mypy (the packages; settings in pyproject.toml)"
python3 -m mypy
echo "== pytest"
# pytest exits 5 when it collects no test: that is a failure here, as is any other non-zero code.
python3 -m pytest -q --durations=20 "$@"  # the 20 slowest tests: the suite must stay well under 30 minutes in CI
