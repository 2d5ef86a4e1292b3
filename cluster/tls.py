"""TLS on gRPC between the cluster's processes, from ``$PDCLUSTER_TLS_*`` (``cluster.envs``).

A node with ``PDCLUSTER_TLS_CERT`` and ``PDCLUSTER_TLS_KEY`` serves TLS only. A process with
``PDCLUSTER_TLS_CA`` (the proxy, a decode node confirming a pull) dials nodes over TLS and checks
their certificate against that CA; the certificate must name the address the node advertises (an
IP or DNS subject alternative name). Nothing set: plaintext gRPC, as on one machine. With the
cluster token (``cluster.auth``) this makes the token secret on the wire as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from cluster import envs


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the TLS {what} {path}: {e}") from None


def server_credentials() -> grpc.ServerCredentials | None:
    """A node's TLS credentials, or None to serve plaintext. Raises ``ValueError`` on half a pair."""
    cert, key, _ = envs.tls_files()
    if (cert is None) != (key is None):
        raise ValueError(f"${envs.TLS_CERT} and ${envs.TLS_KEY} go together: set both or neither")
    if cert is None or key is None:
        return None
    return grpc.ssl_server_credentials([(_read(key, "key"), _read(cert, "certificate"))])


def _channel_credentials() -> grpc.ChannelCredentials | None:
    _, _, ca = envs.tls_files()
    return None if ca is None else grpc.ssl_channel_credentials(root_certificates=_read(ca, "CA certificate"))


def aio_channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to a node: TLS when ``$PDCLUSTER_TLS_CA`` is set."""
    creds = _channel_credentials()
    if creds is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, creds, options=list(options))


def channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A blocking channel to a node: TLS when ``$PDCLUSTER_TLS_CA`` is set."""
    creds = _channel_credentials()
    if creds is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, creds, options=list(options))
