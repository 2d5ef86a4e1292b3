"""Run the proxy: ``python -m proxy --model DIR --registry-url redis://... --cluster NAME``.

Loads the tokenizer and the model's context limit from ``--model``, starts a cached view of the
Redis registry, serves the app with granian (an HTTP server in Rust), and stops the view on exit.
The flags are generated from ``ProxyConfig`` and ``RegistryConfig`` (``cluster.flags``): add a knob
by adding a field.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from cluster import envs, flags
from cluster.config import ProxyConfig, RegistryConfig
from cluster.net import is_loopback
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
    if config.admin_key is None and not config.insecure_admin and not is_loopback(config.host):
        ap.error(f"--host {config.host} is reachable from other machines and no admin key is set: anyone could "
                 f"drain nodes through /admin. Set --admin-key (or ${envs.ADMIN_KEY}), or pass --insecure-admin")
    return config, a.log_level


class RegistrySource:
    """The registry as a ``NodeSource``: reads from the cached view, drain flags through Redis."""

    def __init__(self, view: Any, registry: Any) -> None:
        self._view = view
        self._registry = registry

    def snapshot(self) -> list[NodeState]:
        return self._view.snapshot()

    def set_draining(self, node_id: str, draining: bool) -> bool:
        return self._registry.set_draining(node_id, draining)

    def registry_error(self) -> str | None:
        return self._view.last_error

    def kv_event_stream(self) -> Any:
        return self._registry.kv_event_stream()


ARGV_ENV = "PDCLUSTER_PROXY_ARGV"  # a worker's command line (JSON), set by the parent of several workers


def build_app(config: ProxyConfig) -> Any:
    """The app of one worker: the tokenizer, a cached view of the registry (stopped with the app).

    Raises ``ValueError`` or ``OSError`` when the model directory cannot be loaded.
    """
    from cluster.registry import Registry, RegistryView
    from engine.tokenizer import Tokenizer
    from proxy.app import create_app, model_limits

    tokenizer = Tokenizer(config.model)
    max_len, vocab_size = model_limits(config.model)
    registry = Registry(config.registry)
    view = RegistryView(registry, config.refresh_s)
    view.start()

    def stop() -> None:
        view.stop()
        registry.close()

    try:
        return create_app(config, tokenizer, RegistrySource(view, registry), max_model_len=max_len,
                          vocab_size=vocab_size, on_shutdown=stop)
    except BaseException:
        stop()
        raise


def without_torch() -> None:
    """Keep torch out of this process: the proxy needs the tokenizer, which transformers runs on the
    ``tokenizers`` library alone when torch is absent. ``None`` in ``sys.modules`` makes ``import torch``
    fail and ``importlib.util.find_spec("torch")`` answer None, which is how transformers looks for it.
    A worker then takes ~100 MiB instead of ~250 MiB here, and ~840 MiB on a GPU host (CUDA's libraries)."""
    import os
    import sys

    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its "PyTorch was not found" advice


def worker_app() -> Any:
    """The app factory of each server worker: the parent's command line from ``$ARGV_ENV``."""
    import gc
    import json
    import os
    import sys

    without_torch()
    config, log_level = parse_args(json.loads(os.environ[ARGV_ENV]))
    logging.basicConfig(level=log_level.upper(), format=_LOG_FORMAT)
    if config.pin_workers:  # before this worker starts threads: they inherit the core
        from proxy.affinity import keep_helpers_batched, pin_this_worker

        try:
            if pin_this_worker() is not None:  # pinned: its helper threads share the loop's core
                keep_helpers_batched()
        except (OSError, AttributeError) as e:  # an optimisation: never a reason not to serve
            log.warning("worker not pinned to a CPU core: %s", e)
    try:
        app = build_app(config)
    except (ValueError, OSError) as e:
        log.error("cannot load the model at %s: %s", config.model, e)
        _stop_the_proxy(f"cannot load the model at {config.model}: {e}")
        sys.exit(STARTUP_FAILURE)
    # What startup made (modules, the tokenizer, the app) lives as long as the worker: kept out of the
    # garbage collector's scans, which had been 6% of the worker's main thread under load (py-spy).
    gc.collect()  # startup's garbage first: frozen, it would never be freed
    gc.freeze()
    # A young-generation pass every 700 surviving allocations (Python's default) ran ~100 times a second
    # under load, each scanning the objects of every request in flight and promoting them to be scanned
    # again: 0.42 s of collection in a 6-s window at concurrency 32-128, 0.05 s with this threshold.
    gc.set_threshold(GC_YOUNG_THRESHOLD)
    return app


_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# granian writes its access log whatever the log level: the line per request is an info line, so it is
# written only at info and below (at warning it had cost ~0.15 ms per request at concurrency 1).
_ACCESS_LEVELS = ("debug", "info")
GC_YOUNG_THRESHOLD = 10_000  # surviving allocations between young-generation collections (default 700)
STARTUP_FAILURE = 3  # a worker's exit status when it cannot build its app
FAILED_ENV = "PDCLUSTER_PROXY_STARTUP_FAILED"  # where a worker that cannot build its app says why


def _stop_the_proxy(why: str) -> None:
    """A worker that cannot build its app (its model cannot be loaded: every respawn would fail alike)
    writes why for the parent, and stops it. granian's own crash-loop check misses workers that fail
    in turn: each respawn forgets the others' times, so two failing workers were respawned for ever."""
    import os
    import signal

    where = os.environ.get(FAILED_ENV)
    if where is None:  # not a worker of ``main``
        return
    Path(where).write_text(why)
    os.kill(os.getppid(), signal.SIGINT)  # granian's parent: stop every worker and return


def main(argv: list[str] | None = None) -> None:
    import json
    import multiprocessing
    import os
    import sys
    import tempfile

    config, log_level = parse_args(argv)
    logging.basicConfig(level=log_level.upper(), format=_LOG_FORMAT)
    try:  # a wrong --model fails here, before any worker starts
        json.loads((Path(config.model) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot load the model at {config.model}: {e}") from None
    from granian import Granian  # heavy imports after the arguments are checked
    from granian.constants import HTTPModes, Interfaces, Loops, RuntimeModes
    from granian.log import LogLevels

    from proxy.affinity import CLAIMS_ENV
    from proxy.metrics import MULTIPROC_DIR

    workers = config.workers or len(os.sched_getaffinity(0)) or 1  # 0: one per core this process may use
    where = f"http://{config.host}:{config.port} (registry cluster {config.registry.cluster!r})"
    # Each worker process parses the same command line and builds its own app (worker_app); several
    # write their metrics where /metrics (in any worker) sums them. Workers are spawned, not forked:
    # they import prometheus_client (and grpc) afresh, after the environment below is set.
    multiprocessing.set_start_method("spawn", force=True)
    os.environ[ARGV_ENV] = json.dumps(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="pdcluster-proxy-metrics-") as metrics_dir:
        if workers > 1:
            os.environ[MULTIPROC_DIR] = metrics_dir
        os.environ[CLAIMS_ENV] = str(Path(metrics_dir) / "cpu-claims")  # proxy.affinity
        failed = Path(metrics_dir) / "startup-failed"
        os.environ[FAILED_ENV] = str(failed)
        # A worker that dies is started again (granian; one that dies again within seconds stops the
        # proxy); one that cannot build its app stops the proxy at once (_stop_the_proxy).
        server = Granian("proxy.__main__:worker_app", factory=True, address=config.host, port=config.port,
                         interface=Interfaces.ASGI, workers=workers, loop=Loops.uvloop,
                         runtime_mode=RuntimeModes.st, http=HTTPModes.http1,
                         log_level=LogLevels(log_level), log_access=config.access_log and log_level in _ACCESS_LEVELS,
                         respawn_failed_workers=True, workers_kill_timeout=5)
        log.info("serving with %d worker%s on %s", workers, "s" * (workers > 1), where)
        try:
            server.serve()
            code: object = 0
        except SystemExit as e:
            code = e.code
        if failed.exists():  # a worker stopped the proxy (_stop_the_proxy): its reason
            raise SystemExit(f"error: a proxy worker could not start: {failed.read_text()}")
        if code:
            raise SystemExit(f"error: a proxy worker could not start or kept failing (its log says why); "
                             f"model {config.model}")

if __name__ == "__main__":
    main()
