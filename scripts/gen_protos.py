"""Generate the Python code of protos/ into libra/v1/ (the one command for it).

    python scripts/gen_protos.py          # regenerate
    python scripts/gen_protos.py --check  # exit 1 if libra/v1/ is stale (CI runs this)
"""

from __future__ import annotations

import filecmp
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
PACKAGE = pathlib.PurePosixPath("libra/v1")


def generate(out: pathlib.Path) -> None:
    from grpc_tools import protoc  # dev dependency, imported only here

    sources = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / PACKAGE).glob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out}",
            f"--grpc_python_out={out}", f"--pyi_out={out}", *sources]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    (out / PACKAGE / "__init__.py").write_text(
        '"""Generated from protos/libra/v1 by scripts/gen_protos.py. Do not edit."""\n')


def main() -> int:
    check = "--check" in sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = pathlib.Path(tmp)
        generate(tmp_path)
        fresh, current = tmp_path / PACKAGE, ROOT / PACKAGE
        if check:
            names = sorted({p.name for p in fresh.iterdir()} | {p.name for p in current.glob("*.py*")})
            stale = [n for n in names if not (fresh / n).exists() or not (current / n).exists()
                     or not filecmp.cmp(fresh / n, current / n, shallow=False)]
            if stale:
                print(f"generated code is stale: {', '.join(stale)}; run: python scripts/gen_protos.py")
                return 1
            print("generated code is up to date")
            return 0
        if current.exists():
            shutil.rmtree(current)
        shutil.copytree(fresh, current)
        print(f"wrote {current.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
