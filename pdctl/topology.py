"""The topology of a local cluster for ``pdctl up``: frozen dataclasses, loaded from YAML or flags.

A YAML topology (every key but ``model`` optional; relative paths are relative to the file)::

    model: ./tiny                  # model directory
    served_model_name: tiny        # the name clients pass as "model" (default: the directory's name)
    node_host: 127.0.0.1           # where the nodes listen
    registry:
      url: null                    # an external redis://...; null = start a local redis-server
      port: null                   # the local redis-server's port; null = a free one
      cluster: pdcluster           # key prefix in Redis and the default run directory's name
    proxy: {host: 127.0.0.1, port: 8000, api_key: null, admin_key: null}
    prefill:
      - {dp: 1, pcp: 2, pp: 1, kv_layout: sharded}
    decode:
      - {dp: 1, max_num_seqs: 64}
    engine: native                 # or vllm: in-process vLLM engines with PdKVConnector (DP 1 nodes;
                                   #   tp and dcp keys on nodes, pcp/pp on prefill nodes)
    vllm_python: null              # engine vllm: the nodes' Python (default: $VLLM_VENV/bin/python)

The defaults suit the tiny CPU model (float32 on CPU, 2048-token context). Only what the launcher
needs is checked here, without importing the engine (``pdctl`` stays quick to start); each node
validates its full engine config again when it starts.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

KV_LAYOUTS = ("sharded", "replicated")  # as engine.parallel.grid.KV_LAYOUTS
DTYPES = ("auto", "float32", "bfloat16", "float16")  # as engine.engine_config.DTYPES, plus "auto"
ENGINES = ("native", "vllm")  # as cluster.config.ENGINE_BACKENDS
DEFAULT_VLLM_VENV = "/opt/vllm-venv"  # scripts/test_vllm.sh's default


@dataclass(frozen=True)
class PrefillSpec:
    """One prefill node: DP replicas of PCP x PP ranks."""

    dp: int = 1
    pcp: int = 1
    pp: int = 1
    kv_layout: str = "sharded"
    kv_interleave: int | None = None  # sharded: tokens per run on one PCP rank (default: one block)
    tp: int = 1  # engine vllm: tensor parallel size (MLA's cache is replicated across TP)
    dcp: int = 1  # engine vllm: decode context parallel size (shards the cache)
    engine: str | None = None  # this node's engine (default: the topology's)
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int | None = None  # default: sized by the node from memory
    lease_s: float = 30.0
    port: int = 0  # 0 = the node picks a free port and publishes it in the registry

    def __post_init__(self) -> None:
        _positive_int(self, "dp", "pcp", "pp", "tp", "dcp", "max_model_len", "max_num_batched_tokens")
        _positive(self, "lease_s")
        _positive_or_none(self, "kv_interleave", "num_kv_blocks")
        _choice(self, "kv_layout", KV_LAYOUTS)
        _engine_placement(self)
        _port(self, "port")
        if self.engine is not None:
            _choice(self, "engine", ENGINES)


@dataclass(frozen=True)
class DecodeSpec:
    """One decode node: DP ranks with continuous batching."""

    dp: int = 1
    tp: int = 1  # engine vllm: tensor parallel size
    dcp: int = 1  # engine vllm: decode context parallel size
    engine: str | None = None  # this node's engine (default: the topology's)
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int = 2048
    max_num_seqs: int = 256
    num_kv_blocks: int | None = None
    transfer_timeout_s: float = 30.0
    port: int = 0

    def __post_init__(self) -> None:
        _positive_int(self, "dp", "tp", "dcp", "max_model_len", "max_num_seqs")
        _positive(self, "transfer_timeout_s")
        _positive_or_none(self, "num_kv_blocks")
        _engine_placement(self)
        _port(self, "port")
        if self.engine is not None:
            _choice(self, "engine", ENGINES)


@dataclass(frozen=True)
class ProxySpec:
    """The OpenAI-compatible HTTP front end."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0 = a free port, chosen by the launcher
    api_key: str | None = None
    admin_key: str | None = None

    def __post_init__(self) -> None:
        _port(self, "port")
        for name in ("api_key", "admin_key"):
            if getattr(self, name) == "":
                raise ValueError(f"proxy.{name} must be non-empty when set (use null for none)")


@dataclass(frozen=True)
class RegistrySpec:
    """The Redis registry: an external one, or a local redis-server the launcher starts."""

    url: str | None = None
    port: int | None = None  # the local server's port; None = a free one each time
    cluster: str = "pdcluster"

    def __post_init__(self) -> None:
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
        if any(self.engine_of(s) == "vllm" and s.dp != 1 for s in nodes):
            raise ValueError("engine vllm runs one vLLM engine per node: dp must be 1 (add nodes for replicas)")
        if any(self.engine_of(s) == "native" and (s.tp != 1 or s.dcp != 1) for s in nodes):
            raise ValueError("tp and dcp are for engine vllm; the native engine runs DP x PCP x PP")
        if not self.model:
            raise ValueError("model (the model directory) is required")
        if not self.prefill or not self.decode:
            raise ValueError("a cluster needs at least one prefill node and one decode node")
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

    def engine_of(self, spec: PrefillSpec | DecodeSpec) -> str:
        return spec.engine or self.engine

    def node_python(self, default: str, spec: PrefillSpec | DecodeSpec) -> str:
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
        return dataclasses.asdict(self)


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


def _positive_int(spec: object, *names: str) -> None:
    for name in names:
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be an integer > 0, got {value!r}")


def _positive(spec: object, *names: str) -> None:
    for name in names:
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")


def _positive_or_none(spec: object, *names: str) -> None:
    for name in names:
        value = getattr(spec, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be an integer > 0 or null, got {value!r}")


def _choice(spec: object, name: str, choices: tuple[str, ...]) -> None:
    if getattr(spec, name) not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {getattr(spec, name)!r}")


def _engine_placement(spec: PrefillSpec | DecodeSpec) -> None:
    _choice(spec, "dtype", DTYPES)
    if not isinstance(spec.device, str) or (spec.device not in ("auto", "cpu", "cuda")
                                            and not spec.device.startswith("cuda:")):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {spec.device!r}")


def _port(spec: object, name: str) -> None:
    value = getattr(spec, name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 65536:
        raise ValueError(f"{name} must be a port in [0, 65536), got {value!r}")
