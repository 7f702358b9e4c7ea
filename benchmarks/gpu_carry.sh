#!/usr/bin/env bash
# Fetch here (PyPI and Debian are reachable from the development machine) everything a GPU machine
# without network lacks for `libra up` and the GPU benchmarks; benchmarks/gpu_bootstrap.sh installs it
# there. Both folders are gitignored and travel as carried paths (the device tool's `carry`).
#
#   bash benchmarks/gpu_carry.sh            # -> .whl/*.whl (Python 3.12 wheels), .carry/debs/*.deb
#
#   .whl/        cp312 manylinux wheels, one version each: megatron-core 0.19.2 (the Megatron backend),
#                the control plane's packages the H200 image lacks (pydantic + pydantic-core,
#                annotated-types, typing-inspection, typing-extensions, structlog, redis-py,
#                grpcio-reflection, grpcio-health-checking, uvloop) and grpcio + protobuf at the versions
#                libra/v1 was generated with (the generated code refuses an older runtime)
#   .carry/debs/ Debian 12's redis-server 7.0 and the libraries its binary links that a CUDA image may
#                not have (unpacked into a private prefix there, never into /)
#
# The total is printed last; the device tool carries at most 64 MiB with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
    megatron-core==0.19.2
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
    structlog==26.1.0 redis==8.1.0 uvloop==0.23.0
    grpcio==1.85.3 protobuf==7.36.2 grpcio-reflection==1.85.1 grpcio-health-checking==1.85.1
)
DEBS=(redis-server redis-tools liblzf1 libjemalloc2 libatomic1 libsystemd0 libcap2 libgcrypt20 libgpg-error0 liblz4-1
      libssl3)

mkdir -p .whl .carry/debs
PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
           manylinux1_x86_64; do
    PLATFORMS+=(--platform "$tag")
done
for wheel in "${WHEELS[@]}"; do
    name=${wheel%%==*}
    if ls .whl/ | grep -qi "^${name//-/_}-${wheel##*==}-"; then continue; fi
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
        -d .whl "$wheel"
done

# Debian's packages of this machine's release (bookworm): apt-get download needs no root and installs nothing.
(cd .carry/debs && for deb in "${DEBS[@]}"; do ls "${deb}"_*.deb >/dev/null 2>&1 || apt-get download -q "$deb"; done
 for f in *%3a*.deb; do [ -e "$f" ] && mv "$f" "${f//%3a/-}"; done)  # epochs: plain file names travel safely

python3 - <<'EOF'
import pathlib, re, sys
seen = {}
for path in sorted(pathlib.Path(".whl").glob("*.whl")):
    name = re.split(r"-\d", path.name, 1)[0].lower().replace("_", "-")
    seen.setdefault(name, []).append(path.name)
twice = {n: v for n, v in seen.items() if len(v) > 1}
if twice:
    sys.exit(f"more than one version of {sorted(twice)} in .whl/: keep one (pip refuses the set): {twice}")
EOF
du -ch .whl/*.whl .carry/debs/*.deb | tail -1 | sed 's/total/carried in .whl and .carry (limit 64 MiB with the working tree)/'
