"""Regenerate the gRPC stubs in proto/rngcoord/v1 from the .proto files beside them.

Usage: python scripts/gen_proto.py [OUT_DIR]

With OUT_DIR the stubs are written there instead (tests/test_stubs.py uses it to check that
the committed stubs are current). The stubs are made with grpcio-tools and the type stubs
(`*_pb2.pyi`, `*_pb2_grpc.pyi`) with mypy-protobuf's protoc plugins, both pinned in
pyproject.toml, so the output is byte-for-byte reproducible.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every proto/rngcoord/v1/*.proto; return the files written."""
    protos = sorted(PROTO_ROOT.glob("rngcoord/v1/*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    # mypy-protobuf installs its plugins next to this interpreter.
    plugins = Path(sys.executable).parent
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--plugin=protoc-gen-mypy={plugins / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={plugins / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    return sorted((out_dir / "rngcoord" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT
    for path in generate(target):
        print(path)
