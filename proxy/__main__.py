"""Run the proxy: ``python -m proxy --model DIR --registry-url redis://... --cluster NAME``.

Loads the tokenizer and the model's context limit from ``--model``, starts a cached view of the
Redis registry, serves the app with uvicorn, and stops the view on exit. Flag defaults come from
``ProxyConfig`` and ``RegistryConfig``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from cluster import envs
from cluster.config import ProxyConfig, RegistryConfig
from cluster.nodes import NodeState

log = logging.getLogger("proxy")


def parse_args(argv: list[str] | None = None) -> tuple[ProxyConfig, str]:
    """The proxy's config and log level from the command line."""
    d, r = ProxyConfig(model="."), RegistryConfig()
    ap = argparse.ArgumentParser(prog="python -m proxy", description="pdcluster's OpenAI-compatible proxy")
    ap.add_argument("--model", required=True, help="model directory (tokenizer, chat template, config.json)")
    ap.add_argument("--served-model-name", default=None, help="the name clients use (default: the directory's name)")
    ap.add_argument("--host", default=d.host)
    ap.add_argument("--port", type=int, default=d.port)
    ap.add_argument("--registry-url", default=r.url)
    ap.add_argument("--cluster", default=r.cluster, help="the registry's cluster name (key prefix)")
    ap.add_argument("--api-key", default=envs.api_key(),
                    help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${envs.API_KEY})")
    ap.add_argument("--admin-key", default=envs.admin_key(),
                    help=f"require 'Authorization: Bearer KEY' on /admin/* (default: ${envs.ADMIN_KEY})")
    ap.add_argument("--prefill-timeout-s", type=float, default=d.prefill_timeout_s)
    ap.add_argument("--token-timeout-s", type=float, default=d.token_timeout_s)
    ap.add_argument("--refresh-s", type=float, default=d.refresh_s, help="registry refresh period")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    a = ap.parse_args(argv)
    try:
        config = ProxyConfig(
            model=a.model, served_model_name=a.served_model_name, host=a.host, port=a.port,
            registry=RegistryConfig(url=a.registry_url, cluster=a.cluster), api_key=a.api_key,
            admin_key=a.admin_key, prefill_timeout_s=a.prefill_timeout_s, token_timeout_s=a.token_timeout_s,
            refresh_s=a.refresh_s,
        )
    except ValueError as e:
        ap.error(str(e))
    return config, a.log_level


def model_max_len(model_dir: str) -> int:
    """The model's context limit from its ``config.json`` (``max_position_embeddings``)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return int(raw.get("max_position_embeddings", 4096))


class RegistrySource:
    """The registry as a ``NodeSource``: reads from the cached view, drain flags through Redis."""

    def __init__(self, view: Any, registry: Any) -> None:
        self._view = view
        self._registry = registry

    def snapshot(self) -> list[NodeState]:
        return self._view.snapshot()

    def set_draining(self, node_id: str, draining: bool) -> bool:
        return self._registry.set_draining(node_id, draining)


def main(argv: list[str] | None = None) -> None:
    config, log_level = parse_args(argv)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn  # heavy imports after the arguments are checked

    from cluster.registry import Registry, RegistryView
    from engine.tokenizer import Tokenizer
    from proxy.app import create_app

    try:
        tokenizer = Tokenizer(config.model)
        max_len = model_max_len(config.model)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: cannot load the model at {config.model}: {e}") from None
    registry = Registry(config.registry)
    view = RegistryView(registry, config.refresh_s)
    view.start()
    try:
        app = create_app(config, tokenizer, RegistrySource(view, registry), max_model_len=max_len)
        log.info("serving %s on http://%s:%d (registry cluster %r)", app.state.proxy.model_name, config.host,
                 config.port, config.registry.cluster)
        uvicorn.run(app, host=config.host, port=config.port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        view.stop()
        registry.close()


if __name__ == "__main__":
    main()
