#!/usr/bin/env bash
# Two commits side by side on real processes: benchmarks/headline_cpu.py run from a worktree of
# BASE (the baseline) and from this tree, alternating, one run of each design per round.
#
#   bash benchmarks/headline_ab.sh BASE [ROUNDS] [OUT_DIR] [-- headline_cpu.py options, e.g. --only a b]
#
# Each run's record and history go to OUT_DIR/{base,this}-ROUND (benchmarks/admission_spread.py and
# sim_vs_real.py read them), its JSON line to OUT_DIR/{base,this}-ROUND.json. The worktree runs with
# this tree's virtual environment; PYTHONPATH and a libra/services link make every process it
# starts import the worktree's code (the editable install would otherwise map libra.services here).
set -euo pipefail
cd "$(dirname "$0")/.."
POSITIONAL=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do POSITIONAL+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift  # what is left goes to headline_cpu.py
BASE=${POSITIONAL[0]:?usage: headline_ab.sh BASE [ROUNDS] [OUT_DIR] [-- options]}
ROUNDS=${POSITIONAL[1]:-3}
OUT=${POSITIONAL[2]:-/tmp/libra-ab}
HERE=$(pwd)
TREE=$(mktemp -d /tmp/libra-ab-base.XXXXXX)
git worktree add --detach -q "$TREE" "$BASE"
trap 'git worktree remove --force "$TREE"' EXIT
ln -sfn ../services "$TREE/libra/services"
mkdir -p "$OUT"
for round in $(seq 1 "$ROUNDS"); do
  for side in base this; do
    if [ "$side" = base ]; then root=$TREE; path=$TREE; else root=$HERE; path=; fi
    echo "== round $round, $side ($(cd "$root" && git rev-parse --short HEAD)), load $(cut -d' ' -f1 /proc/loadavg)"
    (cd "$root" && PYTHONPATH=$path "$HERE/.venv/bin/python" benchmarks/headline_cpu.py --runs 1 --steps 30 \
        --keep-runs "$OUT/$side-$round" --json "$OUT/$side-$round.json" --plot "$OUT/$side-$round.png" "$@" \
        | grep -v "^  ")
  done
done
