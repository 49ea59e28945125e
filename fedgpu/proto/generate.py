"""Regenerate the committed gRPC code from the .proto files (`make proto`).

Protos are compiled with the repository root as include path so the generated modules import
each other as `fedgpu.proto.fedgpu.v1.*`, which is where they live in the package.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "fedgpu" / "proto" / "fedgpu" / "v1"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    files = [str(p.relative_to(ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    # protoc resolves the relative file names against the include path, so run from ROOT.
    import os

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        rc = protoc.main(args)
    finally:
        os.chdir(cwd)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")


def main() -> None:
    generate(ROOT)
    print(f"regenerated {len(proto_files())} proto files into {PROTO_DIR}", file=sys.stderr)


if __name__ == "__main__":
    main()
