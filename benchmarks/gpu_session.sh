#!/usr/bin/env bash
# The GPU checks and benchmarks, as run on the H200 device machine (Python 3.12, torch, transformers;
# no network). What the machine lacks comes carried: benchmarks/gpu_carry.sh fetches it here into
# .whl/ and .carry/ (carry both), and benchmarks/gpu_bootstrap.sh installs it there (wheels, Debian's
# redis-server in a private prefix, libra itself). Results go to $OUT (default /tmp/libra-gpu-out);
# e2e also needs the quickstart's warm-started model in .carry/ws_e2e_model.
#
#   bash benchmarks/gpu_session.sh libra-up gpu-tests      # any of the items below, in order
#
#   libra-up    `libra up --config configs/gpu-1.yaml` through every service on one GPU (weights: colocated,
#               packed micro-batches): 25 GRPO steps, reward, versions, step-time breakdown    (~5 min)
#   libra-up-2  the same with configs/gpu-2.yaml on two GPUs (weights group over NCCL)            (~5 min)
#   packing     packed vs padded micro-batches, useful tokens/s and MFU, ~1B model, long-tailed batch (~5 min)
#   colocated   time per version through CUDA IPC handles, 1B and 7B, share and copy           (~2 min)
#   gpu-tests   pytest -m gpu tests/gpu (two-GPU tests skip on one GPU)                         (~2 min)
#   moe         MFU (active parameters) of a small Qwen3-MoE-shaped model next to its dense twin, Megatron (~2 min)
#   lora        LoRA vs full fine-tuning, ~1B model: peak memory and step time, Megatron and torch (~3 min)
#   moe-lora-tests  pytest -m gpu of tests/unit/test_moe.py and test_lora.py (bf16, DDP, checkpoints) (~1 min)
#   and the earlier ones: tests gputests sync syncdirect syncbuckets mfu mfu16 profile pp elastic elastic-megatron e2e
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/libra-gpu-out}
mkdir -p "$OUT"
source benchmarks/gpu_bootstrap.sh || { echo "bootstrap failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
SUMMARY=()

step() {  # step NAME TIMEOUT COMMAND...: runs one item, logs to $OUT/NAME.log, never stops the session
    local name=$1 limit=$2; shift 2
    echo "== $name: $*"
    local started=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "== $name: rc=$rc in $((SECONDS - started)) s"
    SUMMARY+=("$name: rc=$rc in $((SECONDS - started)) s")
}

table() {  # table NAME LINES: an item's closing table again, for the summary at the end
    echo "-- $1"
    tail -n "$2" "$OUT/$1.log"
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
        libra-up) step libra-up 560 python3 benchmarks/gpu_libra_up.py --config configs/gpu-1.yaml --out "$OUT" \
                      --timeout 520 ;;
        libra-up-2) step libra-up-2 560 python3 benchmarks/gpu_libra_up.py --config configs/gpu-2.yaml --out "$OUT" \
                        --timeout 520 ;;
        packing) step packing 540 python3 benchmarks/gpu_packing.py --out "$OUT" --run-timeout 120 ;;
        colocated) step colocated 300 python3 benchmarks/gpu_colocated.py --sets 1b,7b --versions 5 --out "$OUT" ;;
        gpu-tests) step gpu-tests 420 python3 -m pytest -q -p no:cacheprovider tests/gpu \
                       tests/unit/test_packing.py tests/unit/test_colocated.py ;;
        moe) step moe 240 python3 benchmarks/gpu_moe_lora.py --only moe --out "$OUT" --run-timeout 150 ;;
        lora) step lora 240 python3 benchmarks/gpu_moe_lora.py --only lora --out "$OUT" --run-timeout 130 ;;
        moe-lora-tests) step moe-lora-tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_moe.py \
                            tests/unit/test_lora.py ;;
        *) echo "unknown item $item" ;;
    esac
done
echo "== summary"
printf '%s\n' "${SUMMARY[@]}"
for item in "$@"; do
    case $item in
        libra-up|libra-up-2) table "$item" 14 ;;
        packing) table packing 7 ;;
        colocated) table colocated 5 ;;
        gpu-tests) table gpu-tests 6 ;;
        moe) table moe 3 ;;
        lora) table lora 5 ;;
        moe-lora-tests) table moe-lora-tests 3 ;;
    esac
done
