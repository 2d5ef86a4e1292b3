"""The committed generated code is what ``python -m cluster.gen_proto`` writes from the .proto now."""

from __future__ import annotations

import re
from pathlib import Path

from cluster.gen_proto import GEN_DIR, NAME, generate

# Version stamps of the generator differ between grpcio-tools releases; everything else must match.
_STAMPS = re.compile(r"^(# Protobuf Python Version:.*|GRPC_GENERATED_VERSION = .*|\s*\d+,\s*$)$", re.M)


def _normal(text: str) -> str:
    return _STAMPS.sub("", text)


def test_generated_code_is_current(tmp_path: Path) -> None:
    written = generate(tmp_path)
    assert {f.name for f in written} == {f"{NAME}_pb2.py", f"{NAME}_pb2.pyi", f"{NAME}_pb2_grpc.py", "__init__.py"}
    for f in written:
        committed = GEN_DIR / f.name
        assert committed.exists(), f"{committed} is missing: run python -m cluster.gen_proto"
        assert _normal(committed.read_text()) == _normal(f.read_text()), (
            f"{committed} is stale: run python -m cluster.gen_proto"
        )


def test_services_have_the_contracted_methods() -> None:
    from cluster.proto_gen import pdcluster_v1_pb2 as pb

    services = {s.name: [m.name for m in s.methods] for s in pb.DESCRIPTOR.services_by_name.values()}
    assert services == {
        "PrefillService": ["Prefill", "PrefillMux", "Release", "Abort", "Stats"],
        "DecodeService": ["Decode", "DecodeMux", "Abort", "Stats"],
    }
    for service, method in (("PrefillService", "PrefillMux"), ("DecodeService", "DecodeMux")):
        m = pb.DESCRIPTOR.services_by_name[service].methods_by_name[method]
        assert m.server_streaming and m.client_streaming
    assert pb.DESCRIPTOR.package == "pdcluster.v1"
    decode = pb.DESCRIPTOR.services_by_name["DecodeService"].methods_by_name["Decode"]
    assert decode.server_streaming and not decode.client_streaming
