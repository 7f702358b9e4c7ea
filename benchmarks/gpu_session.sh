#!/usr/bin/env bash
# The GPU checks and benchmarks of the Megatron backend, weight sync and elastic join, as run on the
# H200 device machine (Python 3.12, torch, transformers; no network). Wheels the machine lacks are
# carried in .whl/ (megatron-core 0.19.2 cp312, pydantic, structlog, redis, pytest) and installed
# into /tmp/site; e2e also needs the quickstart's warm-started model in .carry/ws_e2e_model. Results go to $OUT (default /tmp/libra-gpu-out).
#
#   bash benchmarks/gpu_session.sh tests sync mfu        # any of: tests gputests sync syncdirect syncbuckets mfu mfu16 profile pp elastic elastic-megatron e2e
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/libra-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -e libra/services ] || ln -sfn ../services libra/services
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, 'transformers', transformers.__version__, 'megatron-core', m.__version__)"

step() {  # step NAME TIMEOUT COMMAND...: runs one item, logs to $OUT/NAME.log, never stops the session
    local name=$1 limit=$2; shift 2
    echo "== $name: $*"
    local started=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "== $name: rc=$rc in $((SECONDS - started)) s"
}

for item in "$@"; do
    case $item in
        tests) step tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/unit/test_megatron_convert.py ;;
        sync) step sync 180 python3 benchmarks/gpu_weight_sync.py --sets 1b,7b --repeats 5 --bucket-mb 256 --flat --trace \
                  --out "$OUT/sync.json" ;;
        syncdirect) step sync-direct 120 python3 benchmarks/gpu_weight_sync.py --sets 1b,7b --repeats 5 --bucket-mb 256 \
                        --direct-mb 8 --out "$OUT/sync-direct.json" ;;
        syncbuckets) for mb in 512 1024; do
                         step sync-bucket$mb 120 python3 benchmarks/gpu_weight_sync.py --sets 1b,7b --repeats 5 \
                             --bucket-mb $mb --out "$OUT/sync-bucket$mb.json"
                     done ;;
        gputests) step gputests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_elastic_pair_group.py ;;
        mfu) step mfu 420 python3 benchmarks/gpu_train_mfu.py --out "$OUT/mfu" \
                 --only torch,megatron-sdpa,megatron-sdpa-unfused,megatron-sdpa-tp2 --run-timeout 120 ;;
        profile) step profile 150 python3 benchmarks/gpu_train_mfu.py --out "$OUT/profile" --only megatron-sdpa \
                     --steps 2 --profile --run-timeout 140 ;;
        mfu16) step mfu16 200 python3 benchmarks/gpu_train_mfu.py --out "$OUT/mfu16" --only megatron-sdpa --micro 16 --run-timeout 170 ;;
        pp) step pp 200 python3 benchmarks/gpu_train_mfu.py --out "$OUT/pp" --only megatron-sdpa-pp2 --micro 4 --run-timeout 170 ;;
        elastic) step elastic 300 python3 benchmarks/elastic_join.py --device cuda:0 --hybrid-device cuda:1 --hidden 1024 \
                     --layers 8 --vocab 32000 --seq-len 512 --groups 4 --threads 4 --json "$OUT/elastic.json" ;;
        elastic-megatron) step elastic-megatron 240 python3 benchmarks/elastic_join.py --backend megatron --device cuda:0 \
                              --hybrid-device cuda:1 --hidden 1024 --layers 8 --vocab 32000 --seq-len 512 --groups 4 \
                              --threads 4 --max-join-s 120 --max-catch-up-steps 160 --json "$OUT/elastic-megatron.json" ;;
        e2e) step e2e 240 python3 benchmarks/gpu_e2e_grpo.py --model .carry/ws_e2e_model --trainer megatron \
                 --dtype bfloat16 --steps 25 --lr 1e-4 --out "$OUT/e2e_megatron" ;;
        *) echo "unknown item $item" ;;
    esac
done
