"""Run the proxy: ``python -m proxy --model DIR --registry-url redis://... --cluster NAME``.

Loads the tokenizer and the model's context limit from ``--model``, starts a cached view of the
Redis registry, serves the app with uvicorn, and stops the view on exit. The flags are generated
from ``ProxyConfig`` and ``RegistryConfig`` (``cluster.flags``): add a knob by adding a field.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from cluster import envs, flags
from cluster.config import ProxyConfig, RegistryConfig
from cluster.nodes import NodeState

log = logging.getLogger("proxy")


# The proxy's flags are ProxyConfig's and RegistryConfig's fields (cluster.flags): to add a knob, add a
# field to the dataclass. Not flags (with why):
_PROXY_NOT_FLAGS = frozenset({"registry"})  # composed from the RegistryConfig flags
_REGISTRY_NOT_FLAGS = frozenset({"heartbeat_s", "ttl_s"})  # the nodes' heartbeat (records carry their TTL)
_RENAMES = {"url": "registry_url"}  # the historic flag name: --registry-url


def parse_args(argv: list[str] | None = None) -> tuple[ProxyConfig, str]:
    """The proxy's config and log level from the command line."""
    ap = argparse.ArgumentParser(prog="python -m proxy", description="pdcluster's OpenAI-compatible proxy")
    # The keys' defaults come from the environment, and --help does not show them (secrets).
    proxy_knobs = flags.knobs(ProxyConfig)
    help_of = {k.name: k.help for k in proxy_knobs}
    keys = {name: {"default": default, "help": f"{help_of[name]} (default: ${var})"}
            for name, default, var in (("api_key", envs.api_key(), envs.API_KEY),
                                       ("admin_key", envs.admin_key(), envs.ADMIN_KEY))}
    flags.add_flags(ap, proxy_knobs, exclude=_PROXY_NOT_FLAGS, overrides=keys)
    flags.add_flags(ap, flags.knobs(RegistryConfig), exclude=_REGISTRY_NOT_FLAGS, renames=_RENAMES)
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                    help="(default: info)")
    a = ap.parse_args(argv)
    try:
        config = flags.build(ProxyConfig, a, exclude=_PROXY_NOT_FLAGS,
                             registry=flags.build(RegistryConfig, a, exclude=_REGISTRY_NOT_FLAGS, renames=_RENAMES))
    except ValueError as e:
        ap.error(str(e))
    if config.admin_key is None and not config.insecure_admin and not _loopback(config.host):
        ap.error(f"--host {config.host} is reachable from other machines and no admin key is set: anyone could "
                 f"drain nodes through /admin. Set --admin-key (or ${envs.ADMIN_KEY}), or pass --insecure-admin")
    return config, a.log_level


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


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
    from proxy.app import create_app, model_limits

    try:
        tokenizer = Tokenizer(config.model)
        max_len, vocab_size = model_limits(config.model)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: cannot load the model at {config.model}: {e}") from None
    registry = Registry(config.registry)
    view = RegistryView(registry, config.refresh_s)
    view.start()
    try:
        app = create_app(config, tokenizer, RegistrySource(view, registry), max_model_len=max_len,
                         vocab_size=vocab_size)
        log.info("serving %s on http://%s:%d (registry cluster %r)", app.state.proxy.model_name, config.host,
                 config.port, config.registry.cluster)
        uvicorn.run(app, host=config.host, port=config.port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        view.stop()
        registry.close()


if __name__ == "__main__":
    main()
