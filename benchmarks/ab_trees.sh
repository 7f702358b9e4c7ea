#!/usr/bin/env bash
# Two commits side by side: one benchmark script run from a worktree of BASE (the baseline) and
# from this tree, alternately, ROUNDS times each; the order flips every round (base first in odd
# rounds, this tree first in even ones), so a machine that speeds up or slows down over the
# session does not favour one side.
#
#   bash benchmarks/ab_trees.sh BASE [ROUNDS] [OUT_DIR] -- SCRIPT [ARGS...]
#   bash benchmarks/ab_trees.sh 60efb30 2 /tmp/ab -- benchmarks/quickstart_race.py --runs 3 --steps 30 \
#       --only quickstart --json {out}.json
#
# In ARGS, {out} becomes OUT_DIR/SIDE-ROUND (SIDE: base or this) for files a run writes; each run's
# output also goes to OUT_DIR/SIDE-ROUND.txt. Both sides run this tree's virtual environment;
# PYTHONPATH and a libra/services link make every process the worktree's run starts import the
# worktree's code (the editable install would otherwise map libra.services to this tree).
set -euo pipefail
cd "$(dirname "$0")/.."
POSITIONAL=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do POSITIONAL+=("$1"); shift; done
USAGE="usage: ab_trees.sh BASE [ROUNDS] [OUT_DIR] -- SCRIPT [ARGS...]"
[ "${1:-}" = "--" ] || { echo "$USAGE" >&2; exit 2; }
shift
[ $# -gt 0 ] || { echo "$USAGE" >&2; exit 2; }
BASE=${POSITIONAL[0]:?$USAGE}
ROUNDS=${POSITIONAL[1]:-3}
OUT=${POSITIONAL[2]:-/tmp/libra-ab}
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a whole number >= 1, got '$ROUNDS'" >&2; exit 2; }
git rev-parse --verify -q "$BASE^{commit}" > /dev/null || { echo "BASE '$BASE' is not a commit here" >&2; exit 2; }
[ -f "$1" ] || { echo "SCRIPT '$1' is not a file of this tree" >&2; exit 2; }
HERE=$(pwd)
TREE=$(mktemp -d /tmp/libra-ab-base.XXXXXX)
git worktree add --detach -q "$TREE" "$BASE"
trap 'git worktree remove --force "$TREE"' EXIT
ln -sfn ../services "$TREE/libra/services"
mkdir -p "$OUT"
for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then sides="base this"; else sides="this base"; fi
  for side in $sides; do
    if [ "$side" = base ]; then root=$TREE; path=$TREE; else root=$HERE; path=; fi
    args=()
    for arg in "$@"; do args+=("${arg//\{out\}/$OUT/$side-$round}"); done
    echo "== round $round, $side ($(cd "$root" && git rev-parse --short HEAD)), load $(cut -d' ' -f1 /proc/loadavg)"
    (cd "$root" && PYTHONPATH=$path "$HERE/.venv/bin/python" "${args[@]}") 2>&1 | tee "$OUT/$side-$round.txt"
  done
done
