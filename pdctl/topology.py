"""The topology of a local cluster for ``pdctl up``: frozen dataclasses, loaded from YAML or flags.

A YAML topology (every key but ``model`` optional; relative paths are relative to the file)::

    model: ./tiny                  # model directory
    served_model_name: tiny        # the name clients pass as "model" (default: the directory's name)
    node_host: 127.0.0.1           # where the nodes listen
    registry:
      url: null                    # an external redis://...; null = start a local redis-server
      port: null                   # the local redis-server's port; null = a free one
      cluster: pdcluster           # key prefix in Redis and the default run directory's name
      ttl_s: null                  # a node silent this long is unhealthy; null = the nodes' 5 s
    proxy: {host: 127.0.0.1, port: 8000, api_key: null, admin_key: null, workers: 1, access_log: true,
            pin_workers: true}
    prefill:
      - {dp: 1, pcp: 2, pp: 1, kv_layout: sharded}
    decode:
      - {dp: 1, max_num_seqs: 64}
    engine: native                 # or vllm: in-process vLLM engines with PdKVConnector (DP 1 nodes;
                                   #   tp and dcp keys on nodes, pcp/pp on prefill nodes)
    vllm_python: null              # engine vllm: the nodes' Python (default: $VLLM_VENV/bin/python)

A node's keys are its process's flags without the dashes (``max_num_seqs: 64`` is ``--max-num-seqs
64``; ``python -m prefill_node --help`` lists them): engine overrides, the fields of ``EngineConfig``,
and node settings, the fields of ``NodeConfig`` (``port``, ``lease_s``, ``engine``, ``tp``, ``dcp``,
...), but for those the launcher sets (``model``, ``node_id``, ``host``, the registry's). Each role
takes its own node flags (``lease_s`` is a prefill node's: ``cluster.config.NODE_ROLE_ONLY``). So a
knob added to a dataclass is a topology key at once: add a knob by adding a field. Unknown keys are
refused, naming the valid ones; for a field that may be None (``max_model_len``, ``num_kv_blocks``,
...), ``null`` asks for the node's default. ``gpus`` may be a list, ``speculative_config`` a mapping
(``{method: mtp, num_speculative_tokens: 2}``: the flag's JSON).

The defaults suit the tiny CPU model (``NODE_DEFAULTS``: float32 on CPU, 2048-token context). Only
what the launcher needs is checked here, without importing the engine (``pdctl`` stays quick to
start: EngineConfig's fields are read from its source, ``cluster.flags.source_knobs``); each node
validates its full engine config again when it starts.
"""

from __future__ import annotations

import functools
import json
import os
import types
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import yaml

from cluster import flags
from cluster.config import DOWN_GRACE_S, ENGINE_BACKENDS, NODE_RENAMES, ROLES, NodeConfig, node_not_flags

KV_LAYOUTS = ("sharded", "replicated")  # as engine.parallel.grid.KV_LAYOUTS
DTYPES = ("auto", "float32", "bfloat16", "float16")  # as engine.engine_config.DTYPES, plus "auto"
ENGINES = ENGINE_BACKENDS
DEFAULT_VLLM_VENV = "/opt/vllm-venv"  # scripts/test_vllm.sh's default
NODE_DEFAULTS: Mapping[str, Any] = types.MappingProxyType(
    {"dtype": "float32", "device": "cpu", "max_model_len": 2048})  # the tiny CPU model's, unlike EngineConfig's
# Node flags the launcher sets from the topology (the RegistryConfig ones from its registry section).
LAUNCHER_SET = frozenset({"model", "node_id", "host"})


@functools.cache
def role_keys(role: str) -> tuple[dict[str, flags.Knob], dict[str, flags.Knob]]:
    """The keys a ``role`` node takes: (engine overrides, node settings), each key -> its field."""
    skip = node_not_flags(role) | LAUNCHER_SET
    engine = {k.name: k for k in flags.source_knobs("engine.engine_config", "EngineConfig") if k.name not in skip}
    node = {flags.key(k.name, NODE_RENAMES): k for k in flags.knobs(NodeConfig) if k.name not in skip}
    return engine, node


@dataclass(frozen=True, init=False, repr=False)
class NodeSpec:
    """One node: its engine overrides and node settings, built from a node entry's keys.

    Both hold only what differs from the node process's own defaults, so the launcher passes exactly
    them as flags, and two specs are equal when their nodes would run alike.
    """

    role: ClassVar[str]
    engine_config: Mapping[str, Any]  # EngineConfig field -> value
    settings: Mapping[str, Any]  # node flag key -> value: NodeConfig's fields ("engine" is engine_backend)

    def __init__(self, **keys: Any) -> None:
        engine_keys, node_keys = role_keys(self.role)
        known = {**engine_keys, **node_keys}
        unknown = sorted(set(keys) - set(known))
        if unknown:
            elsewhere = [f"{k} is a {r} node's" for k in unknown for r in ROLES
                         if r != self.role and any(k in keys_of for keys_of in role_keys(r))]
            where = f" ({', '.join(elsewhere)})" if elsewhere else ""
            raise ValueError(f"unknown keys {unknown}{where}; a {self.role} node takes the EngineConfig fields "
                             f"{sorted(engine_keys)} and the node settings {sorted(node_keys)}")
        values = {**NODE_DEFAULTS, **keys}
        if isinstance(values.get("gpus"), (list, tuple)):  # YAML's gpus: [2, 3] is the flag's "2,3"
            values["gpus"] = ",".join(str(g) for g in values["gpus"])
        if isinstance(values.get("speculative_config"), dict):  # a YAML mapping is the flag's JSON
            values["speculative_config"] = json.dumps(values["speculative_config"])
        for key, value in values.items():
            if key in _CHECKS:
                _CHECKS[key](key, value)
            problem = None if key == "engine" and value is None else flags.type_error(known[key], value)
            if problem:
                raise ValueError(f"{key} {problem}")

        def differing(names: Mapping[str, flags.Knob]) -> Mapping[str, Any]:
            return types.MappingProxyType({k: values[k] for k in names
                                           if k in values and values[k] != self._node_default(k)})

        object.__setattr__(self, "engine_config", differing(engine_keys))
        object.__setattr__(self, "settings", differing(node_keys))

    @classmethod
    def _node_default(cls, key: str) -> Any:
        """The node process's default for ``key``; an ``engine`` key's is the topology's (None)."""
        if key == "engine":
            return None
        engine_keys, node_keys = role_keys(cls.role)
        return (engine_keys.get(key) or node_keys[key]).default

    @classmethod
    def default(cls, key: str) -> Any:
        """A node entry's default for ``key``: NODE_DEFAULTS, else the node process's."""
        return NODE_DEFAULTS[key] if key in NODE_DEFAULTS else cls._node_default(key)

    def value(self, key: str) -> Any:
        """The value this node runs with for ``key`` (``engine``: None for the topology's)."""
        if key in self.engine_config:
            return self.engine_config[key]
        return self.settings.get(key, self._node_default(key))

    def to_dict(self) -> dict[str, Any]:
        """The YAML form, a node entry: the overrides and settings (and NODE_DEFAULTS' keys, which apply
        when left out)."""
        engine = {k: self.value(k) for k in role_keys(self.role)[0] if k in self.engine_config or k in NODE_DEFAULTS}
        return {**engine, **self.settings}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    def __hash__(self) -> int:
        return hash((self.role, tuple(self.to_dict().items())))

    def __reduce__(self) -> tuple[Any, ...]:  # copy and pickle: rebuilt from its keys
        return _node_spec, (type(self), self.to_dict())


def _node_spec(cls: type[NodeSpec], keys: dict[str, Any]) -> NodeSpec:
    return cls(**keys)


class PrefillSpec(NodeSpec):
    """One prefill node: DP replicas of PCP x PP ranks (``PrefillSpec(pcp=2, lease_s=5)``)."""

    role = "prefill"


class DecodeSpec(NodeSpec):
    """One decode node: DP ranks with continuous batching (``DecodeSpec(dp=2, max_num_seqs=64)``)."""

    role = "decode"


@dataclass(frozen=True)
class ProxySpec:
    """The OpenAI-compatible HTTP front end."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0 = a free port, chosen by the launcher
    api_key: str | None = None
    admin_key: str | None = None
    local_prefill_max_tokens: int = 0  # prompts up to this long are prefilled on a decode node
    local_prefill_fallback: bool = True  # and others when no prefill node can take them
    workers: int = 1  # HTTP worker processes sharing the port (0: one per CPU core)
    token_timeout_s: float | None = None  # the proxy's own defaults when None (60 s, 300 s)
    prefill_timeout_s: float | None = None
    access_log: bool = True  # the HTTP server's line per request, at info level
    pin_workers: bool = True  # each worker process on one CPU core (proxy.affinity)

    def __post_init__(self) -> None:
        _port(self, "port")
        for name in ("access_log", "pin_workers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"proxy.{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.workers, int) or self.workers < 0:
            raise ValueError(f"proxy.workers must be an int >= 0, got {self.workers!r}")
        for name in ("token_timeout_s", "prefill_timeout_s"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"proxy.{name} must be a number > 0, got {value!r}")
        if not isinstance(self.local_prefill_max_tokens, int) or self.local_prefill_max_tokens < 0:
            raise ValueError("proxy.local_prefill_max_tokens must be an int >= 0, got "
                             f"{self.local_prefill_max_tokens!r}")
        for name in ("api_key", "admin_key"):
            if getattr(self, name) == "":
                raise ValueError(f"proxy.{name} must be non-empty when set (use null for none)")


@dataclass(frozen=True)
class RegistrySpec:
    """The Redis registry: an external one, or a local redis-server the launcher starts."""

    url: str | None = None
    port: int | None = None  # the local server's port; None = a free one each time
    cluster: str = "pdcluster"
    ttl_s: float | None = None  # a node silent this long is unhealthy (None: the nodes' default, 5 s)

    def __post_init__(self) -> None:
        if self.ttl_s is not None and (isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, (int, float))
                                       or self.ttl_s <= 1.0):
            raise ValueError(f"registry.ttl_s must be a number of seconds > 1 (nodes beat every second), "
                             f"got {self.ttl_s!r}")
        if self.url is not None and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"registry.url must be redis://, rediss:// or unix://, got {self.url!r}")
        if self.url is not None and self.port is not None:
            raise ValueError("registry.port is for a local redis-server: give either url or port")
        if self.port is not None and not 0 < self.port < 65536:
            raise ValueError(f"registry.port must be in (0, 65536), got {self.port}")
        if not self.cluster or ":" in self.cluster or "/" in self.cluster:
            raise ValueError(f"registry.cluster must be non-empty without ':' or '/', got {self.cluster!r}")


@dataclass(frozen=True)
class Topology:
    """A whole local cluster: the model, the registry, the proxy and the nodes."""

    model: str
    prefill: tuple[PrefillSpec, ...] = field(default_factory=lambda: (PrefillSpec(),))
    decode: tuple[DecodeSpec, ...] = field(default_factory=lambda: (DecodeSpec(),))
    served_model_name: str | None = None
    node_host: str = "127.0.0.1"
    proxy: ProxySpec = field(default_factory=ProxySpec)
    registry: RegistrySpec = field(default_factory=RegistrySpec)
    engine: str = "native"  # the nodes' engine: "native" or "vllm" (in-process vLLM, PdKVConnector; DP 1, TP/DCP)
    vllm_python: str | None = None  # engine vllm: the nodes' Python (default: $VLLM_VENV/bin/python)

    def __post_init__(self) -> None:
        _choice(self, "engine", ENGINES)
        if self.vllm_python == "":
            raise ValueError("vllm_python must be non-empty when set")
        nodes = (*self.prefill, *self.decode)
        if any(self.engine_of(s) == "vllm" and s.value("dp") != 1 for s in nodes):
            raise ValueError("engine vllm runs one vLLM engine per node: dp must be 1 (add nodes for replicas)")
        if any(self.engine_of(s) == "native" and (s.value("tp") != 1 or s.value("dcp") != 1) for s in nodes):
            raise ValueError("tp and dcp are for engine vllm; the native engine runs DP x PCP x PP")
        if not self.model:
            raise ValueError("model (the model directory) is required")
        if not self.decode:
            raise ValueError("a cluster needs at least one decode node")
        if not self.prefill and not any(self.engine_of(s) == "native" for s in self.decode):
            raise ValueError("a cluster without prefill nodes (colocated: decode nodes prefill locally) needs "
                             "native decode nodes")
        if (any(self.engine_of(s) == "vllm" for s in self.prefill)
                and not any(self.engine_of(s) == "vllm" for s in self.decode)):
            raise ValueError("a vLLM prefill node's KV can be read only by vLLM decode nodes: add one "
                             "(native prefill nodes serve both engines)")
        if not self.node_host:
            raise ValueError("node_host must be non-empty")
        if self.served_model_name == "":
            raise ValueError("served_model_name must be non-empty when set")

    @property
    def cluster(self) -> str:
        return self.registry.cluster

    def engine_of(self, spec: NodeSpec) -> str:
        return spec.value("engine") or self.engine

    def node_python(self, default: str, spec: NodeSpec) -> str:
        """The Python a node runs with: ``default`` for native nodes, a vLLM venv's for vLLM ones."""
        if self.engine_of(spec) != "vllm":
            return default
        return self.vllm_python or str(Path(os.environ.get("VLLM_VENV", DEFAULT_VLLM_VENV)) / "bin" / "python")

    @staticmethod
    def from_dict(d: dict[str, Any], base_dir: Path | None = None) -> Topology:
        """Build from the YAML form; a relative ``model`` is taken relative to ``base_dir``."""
        _known_keys("topology", d, Topology)
        if "model" not in d:
            raise ValueError("topology: 'model' (the model directory) is required")
        model = Path(str(d["model"])).expanduser()
        if base_dir is not None and not model.is_absolute():
            model = base_dir / model
        kwargs: dict[str, Any] = {k: v for k, v in d.items()
                                  if k in ("served_model_name", "node_host", "engine", "vllm_python")}
        if "prefill" in d:
            kwargs["prefill"] = tuple(_spec(PrefillSpec, s, f"prefill[{i}]") for i, s in enumerate(_list(d, "prefill")))
        if "decode" in d:
            kwargs["decode"] = tuple(_spec(DecodeSpec, s, f"decode[{i}]") for i, s in enumerate(_list(d, "decode")))
        if d.get("proxy") is not None:
            kwargs["proxy"] = _spec(ProxySpec, d["proxy"], "proxy")
        if d.get("registry") is not None:
            kwargs["registry"] = _spec(RegistrySpec, d["registry"], "registry")
        return Topology(model=str(model), **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The YAML form (``from_dict`` reads it back)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**d, "prefill": [s.to_dict() for s in self.prefill], "decode": [s.to_dict() for s in self.decode],
                "proxy": asdict(self.proxy), "registry": asdict(self.registry)}


def load_topology(path: Path) -> Topology:
    """Read a YAML topology; ``ValueError`` names what is wrong."""
    try:
        d = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read topology {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"topology {path} is not valid YAML: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"topology {path}: expected a mapping at the top level")
    return Topology.from_dict(d, base_dir=path.resolve().parent)


def _spec(cls: type, value: object, where: str) -> Any:
    if not isinstance(value, dict):
        raise ValueError(f"topology {where}: expected a mapping, got {value!r}")
    if not issubclass(cls, NodeSpec):  # a node spec checks its keys itself
        _known_keys(f"topology {where}", value, cls)
    try:
        return cls(**value)
    except TypeError as e:  # a wrong type that the checks in __post_init__ tripped over
        raise ValueError(f"topology {where}: {e}") from None
    except ValueError as e:
        raise ValueError(f"topology {where}: {e}") from None


def _list(d: dict[str, Any], key: str) -> list[Any]:
    value = d[key]
    if not isinstance(value, list):
        raise ValueError(f"topology {key}: expected a list of nodes, got {value!r}")
    return value


def _known_keys(where: str, d: dict[str, Any], cls: type) -> None:
    unknown = sorted(set(d) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(f.name for f in fields(cls))}")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be an integer > 0, got {value!r}")


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


def _positive_int_or_none(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name} must be an integer > 0 or null, got {value!r}")


def _one_of(choices: tuple[Any, ...]) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return check


def _device(name: str, value: Any) -> None:
    if not isinstance(value, str) or (value not in ("auto", "cpu", "cuda") and not value.startswith("cuda:")):
        raise ValueError(f"{name} must be 'auto', 'cpu' or 'cuda[:N]', got {value!r}")


def _grace(name: str, value: Any) -> None:
    # pdctl down waits DOWN_GRACE_S for each process before SIGKILL: a node's grace must end well before.
    if not isinstance(value, (int, float)) or not 0 <= value <= DOWN_GRACE_S - 15:
        raise ValueError(f"{name} must be in [0, {DOWN_GRACE_S - 15:g}] (pdctl down kills a node after "
                         f"{DOWN_GRACE_S:g} s), got {value!r}")


def _port_value(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 65536:
        raise ValueError(f"{name} must be a port in [0, 65536), got {value!r}")


def _gpus(name: str, value: Any) -> None:
    if value is None:
        return
    parts = str(value).split(",")
    if not all(p.strip().isdigit() for p in parts) or len(set(parts)) != len(parts):
        raise ValueError(f"{name} must list distinct GPU indices (e.g. [2, 3]), got {value!r}")


# Value checks of node keys, beyond their types (flags.type_error): what the launcher needs, and the
# mistakes worth catching before anything starts. Each node validates its whole config again.
_CHECKS: dict[str, Callable[[str, Any], None]] = {
    **dict.fromkeys(("dp", "pcp", "pp", "tp", "dcp", "max_num_batched_tokens", "max_num_seqs", "block_size"),
                    _positive_int),
    **dict.fromkeys(("max_model_len", "num_kv_blocks", "kv_interleave"), _positive_int_or_none),
    **dict.fromkeys(("lease_s", "transfer_timeout_s"), _positive),
    "kv_layout": _one_of(KV_LAYOUTS), "dtype": _one_of(DTYPES), "device": _device, "port": _port_value,
    "grace_s": _grace, "gpus": _gpus,
    "engine": lambda name, value: None if value is None else _one_of(ENGINES)(name, value),  # None: the topology's
}


def _choice(spec: object, name: str, choices: tuple[str, ...]) -> None:
    if getattr(spec, name) not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {getattr(spec, name)!r}")


def _port(spec: object, name: str) -> None:
    _port_value(name, getattr(spec, name))
