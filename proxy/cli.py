"""Command-line flags of the proxy (``python -m proxy``), and its log lines' format.

The flags are generated from ``ProxyConfig`` and ``RegistryConfig`` (``cluster.flags``): to add a knob,
add a field to the dataclass. The parent process and every worker process (``proxy.workers``) parse
the same command line here.
"""

from __future__ import annotations

import argparse
import logging

from cluster import envs, flags
from cluster.config import ProxyConfig, RegistryConfig
from cluster.net import is_loopback

# The proxy's flags are ProxyConfig's and RegistryConfig's fields (cluster.flags): to add a knob, add a
# field to the dataclass. Not flags (with why):
_PROXY_NOT_FLAGS = frozenset({"registry"})  # composed from the RegistryConfig flags
_REGISTRY_NOT_FLAGS = frozenset({"heartbeat_s", "ttl_s"})  # the nodes' heartbeat (records carry their TTL)
_RENAMES = {"url": "registry_url"}  # the historic flag name: --registry-url

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
    if config.admin_key is None and not config.insecure_admin and not is_loopback(config.host):
        ap.error(f"--host {config.host} is reachable from other machines and no admin key is set: anyone could "
                 f"drain nodes through /admin. Set --admin-key (or ${envs.ADMIN_KEY}), or pass --insecure-admin")
    return config, a.log_level


def start_logging(log_level: str) -> None:
    """Log at ``log_level`` (a ``--log-level`` choice), in the proxy's format."""
    logging.basicConfig(level=log_level.upper(), format=_LOG_FORMAT)
