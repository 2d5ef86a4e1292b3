"""The proxy's worker processes: how ``python -m proxy`` starts them, and how each one sets itself up.

``serve`` runs the app with granian in worker processes (one by default, ``--workers N`` for N on one
socket). Each is spawned and builds its own app in ``worker_app``: it parses the parent's command line
(``proxy.cli``), keeps torch out of its process, is pinned to a CPU core (``proxy.affinity``), builds
its app (its own registry view, node channels and in-flight counts), and then takes what startup made
out of the garbage collector's scans. A worker that dies is started again; one that cannot build its
app stops the proxy, which exits with that worker's reason.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from cluster.config import ProxyConfig
from proxy.cli import parse_args, start_logging

log = logging.getLogger("proxy")

ARGV_ENV = "PDCLUSTER_PROXY_ARGV"  # a worker's command line (JSON), set by the parent of the workers
FAILED_ENV = "PDCLUSTER_PROXY_STARTUP_FAILED"  # where a worker that cannot build its app says why
STARTUP_FAILURE = 3  # a worker's exit status when it cannot build its app
GC_YOUNG_THRESHOLD = 10_000  # surviving allocations between young-generation collections (default 700)
# granian writes its access log whatever the log level: the line per request is an info line, so it is
# written only at info and below (at warning it had cost ~0.15 ms per request at concurrency 1).
_ACCESS_LEVELS = ("debug", "info")


def serve(config: ProxyConfig, argv: list[str], log_level: str) -> None:
    """Serve the app in ``config.workers`` worker processes (0: one per core this process may use) until
    the server stops; ``argv`` is the command line every worker parses. Raises ``SystemExit`` with the
    reason when a worker could not start or kept failing."""
    import json
    import multiprocessing
    import os
    import tempfile

    from granian import Granian  # heavy imports only once the arguments are checked
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
    os.environ[ARGV_ENV] = json.dumps(argv)
    with tempfile.TemporaryDirectory(prefix="pdcluster-proxy-metrics-") as metrics_dir:
        if workers > 1:
            os.environ[MULTIPROC_DIR] = metrics_dir
        os.environ[CLAIMS_ENV] = str(Path(metrics_dir) / "cpu-claims")  # proxy.affinity
        failed = Path(metrics_dir) / "startup-failed"
        os.environ[FAILED_ENV] = str(failed)
        # A worker that dies is started again (granian; one that dies again within seconds stops the
        # proxy); one that cannot build its app stops the proxy at once (_stop_the_proxy).
        server = Granian("proxy.workers:worker_app", factory=True, address=config.host, port=config.port,
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


def worker_app() -> Any:
    """The app factory of each server worker: the parent's command line from ``$ARGV_ENV``."""
    import json
    import os
    import sys

    without_torch()
    config, log_level = parse_args(json.loads(os.environ[ARGV_ENV]))
    start_logging(log_level)
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
    _settle_the_collector()
    return app


def build_app(config: ProxyConfig) -> Any:
    """The app of one worker: the tokenizer, a cached view of the registry (stopped with the app).

    Raises ``ValueError`` or ``OSError`` when the model directory cannot be loaded.
    """
    from cluster.registry import Registry, RegistryView
    from engine.tokenizer import Tokenizer
    from proxy.app import create_app, model_limits
    from proxy.routing.discovery import RegistrySource

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


def _settle_the_collector() -> None:
    """The garbage collector set for a long-lived server, once the worker's app is built."""
    import gc

    # What startup made (modules, the tokenizer, the app) lives as long as the worker: kept out of the
    # garbage collector's scans, which had been 6% of the worker's main thread under load (py-spy).
    gc.collect()  # startup's garbage first: frozen, it would never be freed
    gc.freeze()
    # A young-generation pass every 700 surviving allocations (Python's default) ran ~100 times a second
    # under load, each scanning the objects of every request in flight and promoting them to be scanned
    # again: 0.42 s of collection in a 6-s window at concurrency 32-128, 0.05 s with this threshold.
    gc.set_threshold(GC_YOUNG_THRESHOLD)


def _stop_the_proxy(why: str) -> None:
    """A worker that cannot build its app (its model cannot be loaded: every respawn would fail alike)
    writes why for the parent, and stops it. granian's own crash-loop check misses workers that fail
    in turn: each respawn forgets the others' times, so two failing workers were respawned for ever."""
    import os
    import signal

    where = os.environ.get(FAILED_ENV)
    if where is None:  # not a worker of ``serve``
        return
    Path(where).write_text(why)
    os.kill(os.getppid(), signal.SIGINT)  # granian's parent: stop every worker and return
