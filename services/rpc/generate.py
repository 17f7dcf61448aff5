"""Generate the Python stubs of proto/worker.proto into services/rpc/ (or --out DIR).

Run by the install step (Makefile) and by the test that checks the installed stubs are not
stale. grpc_tools writes absolute imports (`import worker_pb2`); they are made relative so the
stubs live inside this package and shadow no other package's import name.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto" / "worker.proto"
HERE = Path(__file__).resolve().parent
OUTPUTS = ("worker_pb2.py", "worker_pb2.pyi", "worker_pb2_grpc.py")


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO.parent}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", str(PROTO)]  # fmt: skip
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {PROTO}")
        written = []
        for name in OUTPUTS:
            text = (Path(tmp) / name).read_text()
            text = re.sub(r"^import worker_pb2 as", "from . import worker_pb2 as", text, flags=re.M)
            target = out / name
            target.write_text(text)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"generated {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
