# Make a bare GPU machine with no network ready for `libra up` and the GPU benchmarks, from what
# benchmarks/gpu_carry.sh fetched (.whl/, .carry/debs/). Source it from the repository root:
#
#   source benchmarks/gpu_bootstrap.sh          # then: libra up --config configs/gpu-1.yaml
#
#   wheels   python3 -m pip install --no-deps --target $LIBRA_SITE (first on PYTHONPATH, so the carried
#            grpcio/protobuf/typing-extensions win over the image's)
#   redis    Debian's redis-server and its libraries unpacked into $LIBRA_PREFIX (dpkg -x; never into /),
#            started through a wrapper on PATH that points the loader at them (nothing else sees them)
#   libra    pip install --no-deps --no-build-isolation -e . (offline; the `libra` command), else the
#            checkout on PYTHONPATH with libra/services linked to services/ and a `libra` shim
# NVLink multicast stays off (shared machines). Prints what it set up; returns non-zero if a piece failed.
LIBRA_SITE=${LIBRA_SITE:-/tmp/libra-site}
LIBRA_PREFIX=${LIBRA_PREFIX:-/tmp/libra-prefix}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

_libra_bootstrap() {
    local root=$PWD
    [ -f "$root/pyproject.toml" ] && [ -d "$root/services" ] || { echo "bootstrap: run from the repository root"; return 1; }
    ls .whl/*.whl >/dev/null 2>&1 || { echo "bootstrap: no .whl/ (run benchmarks/gpu_carry.sh here, carry .whl)"; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$LIBRA_SITE" .whl/*.whl \
        || { echo "bootstrap: wheel install failed"; return 1; }
    export PYTHONPATH="$LIBRA_SITE${PYTHONPATH:+:$PYTHONPATH}"

    mkdir -p "$LIBRA_PREFIX/bin"
    local deb
    for deb in .carry/debs/*.deb; do
        [ -e "$deb" ] || { echo "bootstrap: no .carry/debs (carry .carry)"; return 1; }
        dpkg -x "$deb" "$LIBRA_PREFIX" 2>/dev/null || python3 - "$deb" "$LIBRA_PREFIX" <<'EOF' || return 1
import io, sys, tarfile
# A .deb is an ar archive; its data.tar.* holds the files (dpkg-deb missing on this image).
data = open(sys.argv[1], "rb").read()
assert data[:8] == b"!<arch>\n", "not a .deb"
at = 8
while at < len(data):
    name, size = data[at:at + 16].decode().strip().rstrip("/"), int(data[at + 48:at + 58])
    if name.startswith("data.tar"):
        tarfile.open(fileobj=io.BytesIO(data[at + 60:at + 60 + size])).extractall(sys.argv[2])
        break
    at += 60 + size + size % 2
EOF
    done
    local libs="$LIBRA_PREFIX/usr/lib/x86_64-linux-gnu:$LIBRA_PREFIX/lib/x86_64-linux-gnu"
    local binary="$LIBRA_PREFIX/usr/bin/redis-server"  # a link to redis-check-rdb, which acts by its argv[0]
    printf '#!/bin/sh\nLD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s" "$@"\n' "$libs" "$binary" \
        > "$LIBRA_PREFIX/bin/redis-server"
    chmod +x "$LIBRA_PREFIX/bin/redis-server"
    export PATH="$LIBRA_PREFIX/bin:$PATH"
    if ! redis-server --version; then
        LD_LIBRARY_PATH="$libs" ldd "$binary" | grep "not found"
        echo "bootstrap: redis-server does not run (libraries above not found: add their Debian packages to gpu_carry.sh)"
        return 1
    fi

    if python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/libra-editable.log 2>&1 \
            && command -v libra >/dev/null && python3 -c "import libra.services.trainer.server" 2>/dev/null; then
        echo "bootstrap: libra installed (editable): $(command -v libra)"
    else
        echo "bootstrap: editable install unavailable ($(tail -n 1 /tmp/libra-editable.log)); using the checkout on PYTHONPATH"
        [ -e libra/services ] || ln -sfn ../services libra/services
        export PYTHONPATH="$PYTHONPATH:$root"
        printf '#!/bin/sh\nexec python3 -m libra.cli "$@"\n' > "$LIBRA_PREFIX/bin/libra"
        chmod +x "$LIBRA_PREFIX/bin/libra"
        python3 -c "import libra.services.trainer.server" || { echo "bootstrap: libra does not import"; return 1; }
    fi
    python3 -c "import torch, transformers, grpc, google.protobuf, pydantic, megatron.core as m; \
print('bootstrap: torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count(), \
'| transformers', transformers.__version__, '| grpcio', grpc.__version__, '| protobuf', google.protobuf.__version__, \
'| pydantic', pydantic.__version__, '| megatron-core', m.__version__)"
}
_libra_bootstrap
