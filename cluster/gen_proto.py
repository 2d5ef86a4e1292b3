"""Regenerate ``cluster/proto_gen`` from ``cluster/proto/pdcluster_v1.proto``: ``python -m cluster.gen_proto``.

The generated files are committed; ``tests/unit/test_proto.py`` checks they match what this writes.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent / "proto"
GEN_DIR = Path(__file__).resolve().parent / "proto_gen"
NAME = "pdcluster_v1"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into ``out_dir``; make the grpc module import its messages relatively."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(PROTO_DIR / f"{NAME}.proto")]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    grpc_file = out_dir / f"{NAME}_pb2_grpc.py"
    text = grpc_file.read_text()
    grpc_file.write_text(re.sub(rf"^import {NAME}_pb2 as", f"from . import {NAME}_pb2 as", text, flags=re.M))
    init = out_dir / "__init__.py"
    init.write_text('"""Generated from cluster/proto/pdcluster_v1.proto by ``python -m cluster.gen_proto``."""\n')
    return sorted(out_dir.glob(f"{NAME}_pb2*")) + [init]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        for f in files:
            (GEN_DIR / f.name).write_bytes(f.read_bytes())
    print(f"wrote {len(files)} files to {GEN_DIR}", file=sys.stderr)


if __name__ == "__main__":
    main()
