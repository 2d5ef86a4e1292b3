"""Command-line flags of the node processes (``python -m prefill_node`` / ``python -m decode_node``).

The flags are generated from ``NodeConfig``, ``RegistryConfig`` and ``EngineConfig`` (``cluster.flags``):
to add a knob, add a field to the dataclass; it becomes a flag of both roles with the field's default
and help, and a key of a ``pdctl up`` topology's nodes. The fields that are no flags, those of one role
only, and the historic flag names (``--engine``, ``--registry-url``) are ``cluster.config.NODE_*``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster import flags
from cluster.config import NODE_RENAMES, NodeConfig, RegistryConfig, node_not_flags
from engine.engine_config import EngineConfig


def parser(role: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"python -m {role}_node", description=f"pdcluster {role} node (gRPC)")
    skip = node_not_flags(role)
    node = ap.add_argument_group("node")
    node.add_argument("--served-model-name", default=None, metavar="NAME",
                      help="the model name clients use (default: the model directory's name)")
    flags.add_flags(node, flags.knobs(NodeConfig), exclude=skip, renames=NODE_RENAMES)
    registry = ap.add_argument_group("registry")
    flags.add_flags(registry, flags.knobs(RegistryConfig), exclude=skip, renames=NODE_RENAMES)
    engine = ap.add_argument_group("engine")
    flags.add_flags(engine, flags.knobs(EngineConfig), exclude=skip, renames=NODE_RENAMES)
    return ap


def parse(role: str, argv: list[str] | None = None) -> tuple[NodeConfig, str]:
    """Flags -> (NodeConfig, served model name). Invalid values exit with the parser's error."""
    ap = parser(role)
    a = ap.parse_args(argv)
    skip = node_not_flags(role)
    try:
        node = flags.build(
            NodeConfig, a, exclude=skip, renames=NODE_RENAMES, role=role,
            engine=flags.build(EngineConfig, a, exclude=skip, renames=NODE_RENAMES),
            registry=flags.build(RegistryConfig, a, exclude=skip, renames=NODE_RENAMES),
        )
    except ValueError as e:
        ap.error(str(e))
    if not Path(node.engine.model, "config.json").is_file():
        ap.error(f"--model {node.engine.model}: no config.json there")
    return node, a.served_model_name or Path(node.engine.model).resolve().name
