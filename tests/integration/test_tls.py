"""gRPC over TLS (``cluster.tls``): a prefill node process with ``$PDCLUSTER_TLS_CERT``/``KEY`` serves
TLS only; the proxy's client and the decode side's confirmer reach it with ``$PDCLUSTER_TLS_CA``
(and the cluster token); plaintext and a client trusting another CA are refused."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from procs import wait_registered

from cluster.auth import call_metadata
from cluster.config import RegistryConfig
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
from cluster.registry import Registry
from node_runtime.confirm import PrefillConfirmer
from pdctl.redis_server import start_redis
from proxy.link.clients import NodeClients

TOKEN = "tls-test-token"
PROMPT = [(i * 5 + 3) % 1000 + 2 for i in range(40)]


def _pem(obj: x509.Certificate | ec.EllipticCurvePrivateKey) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def make_node_cert(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "p0")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return _pem(cert), _pem(key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca, ca_key = make_ca("pdcluster test CA")
    other, _ = make_ca("another CA")
    cert, key = make_node_cert(ca, ca_key)
    files = {"ca": _pem(ca), "other_ca": _pem(other), "cert": cert, "key": key}
    for name, data in files.items():
        (d / f"{name}.pem").write_bytes(data)
    return {name: d / f"{name}.pem" for name in files}


@pytest.fixture(scope="module")
def node(tiny_model: Path, pki: dict[str, Path]) -> Iterator[str]:
    """A prefill node serving TLS with the cluster token; yields its address."""
    redis = start_redis()
    env = {**os.environ, "PDCLUSTER_TLS_CERT": str(pki["cert"]), "PDCLUSTER_TLS_KEY": str(pki["key"]),
           "PDCLUSTER_CLUSTER_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefill_node", "--model", str(tiny_model), "--node-id", "p0", "--registry-url",
         redis.url, "--cluster", "tls", "--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
         "--num-kv-blocks", "32"], env=env, start_new_session=True)
    registry = Registry(RegistryConfig(url=redis.url, cluster="tls"))
    try:
        yield wait_registered(proc, registry).info.address
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0
        registry.close()
        redis.stop()


def prefill_request(rid: str) -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=rid, token_ids=PROMPT, dp_rank=-1,
                             sampling=pb.SamplingParams(temperature=0, max_tokens=4))


def test_plaintext_and_a_client_trusting_another_ca_are_refused(node: str, pki: dict[str, Path]) -> None:
    with grpc.insecure_channel(node) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.PrefillServiceStub(ch).Abort(pb.AbortRequest(request_id="x"), timeout=5,
                                                 metadata=call_metadata(TOKEN))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    creds = grpc.ssl_channel_credentials(root_certificates=pki["other_ca"].read_bytes())
    with grpc.secure_channel(node, creds) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.PrefillServiceStub(ch).Abort(pb.AbortRequest(request_id="x"), timeout=5,
                                                 metadata=call_metadata(TOKEN))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_proxy_and_the_confirmer_reach_it_over_tls(node: str, pki: dict[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLUSTER_TLS_CA", str(pki["ca"]))
    monkeypatch.setenv("PDCLUSTER_CLUSTER_TOKEN", TOKEN)

    async def through_the_proxys_client() -> pb.PrefillResponse:
        clients = NodeClients()
        try:
            return await clients.prefill(node).Prefill(prefill_request("t1"), timeout=60, metadata=clients.metadata)
        finally:
            await clients.close()

    reply = asyncio.run(through_the_proxys_client())
    assert reply.kv.num_blocks > 0  # held under a lease, as for a decode node to pull
    confirm = PrefillConfirmer()
    try:
        assert confirm(node, "t1") is True  # the decode side's Release, over TLS with the token
    finally:
        confirm.close()
    with grpc.secure_channel(node, grpc.ssl_channel_credentials(pki["ca"].read_bytes())) as ch:
        stub = pb_grpc.PrefillServiceStub(ch)
        # That Release ended the lease: a second finds nothing.
        assert not stub.Release(pb.ReleaseRequest(request_id="t1"), timeout=5, metadata=call_metadata(TOKEN)).found
