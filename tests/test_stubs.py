"""The committed gRPC stubs must be exactly what scripts/gen_proto.py makes from proto/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _generate(out_dir: Path) -> list[Path]:
    """scripts/gen_proto.py's `generate`, loaded from its file (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generated: list[Path] = module.generate(out_dir)
    return generated


@pytest.mark.slow
def test_stubs_regenerate_byte_identical(tmp_path: Path) -> None:
    generated = _generate(tmp_path)
    assert generated, "protoc produced no stubs"
    committed_dir = ROOT / "proto" / "rngcoord" / "v1"
    stale = [p.name for p in generated if (committed_dir / p.name).read_bytes() != p.read_bytes()]
    assert not stale, f"stale stubs {stale}: run `make proto` and commit the result"
    committed = {p.name for p in committed_dir.glob("*_pb2*.py*")}
    assert committed == {p.name for p in generated}, "stub files differ from what protoc makes"
