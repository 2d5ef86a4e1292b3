"""Run the proxy: ``python -m proxy --model DIR --registry-url redis://... --cluster NAME``.

Parses the command line (``proxy.cli``: the flags are generated from ``ProxyConfig`` and
``RegistryConfig``), reports a model directory it cannot load before any worker starts, and serves
the app in worker processes (``proxy.workers``): each loads the tokenizer and the model's context
limit from ``--model`` and starts a cached view of the Redis registry, stopped on exit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from proxy.cli import parse_args, start_logging
from proxy.workers import serve


def main(argv: list[str] | None = None) -> None:
    config, log_level = parse_args(argv)
    start_logging(log_level)
    try:  # a wrong --model fails here, before any worker starts
        json.loads((Path(config.model) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot load the model at {config.model}: {e}") from None
    serve(config, sys.argv[1:] if argv is None else argv, log_level)


if __name__ == "__main__":
    main()
