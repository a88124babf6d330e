#!/usr/bin/env bash
# The quantized-weights GPU measurements of issue 44 in one command, on one H100 or H200 (<= 8 min):
#   kernels  bench_quant_kernels.py on the Qwen3-8B layer shapes, M = 1..16 and 64..4096 (incl. torch._scaled_mm)
#   batch1   bench.py --num-seqs 1 for qwen3-8b, -fp8 and -awq (batch-1 decode: targets 1.7x / 2.3x bf16)
#   mem      the 8 GiB starts: qwen3-8b-awq (>= 1.2 GiB KV), the same with --quantize-lm-head int8 (>= 2 GiB),
#            qwen3-4b-fp8 (>= 3 GiB), then two diagnostics: 4B FP8 with the int8 (tied) embedding, 8B AWQ with
#            a 4,096-token step
#   mem97    the two int8-head starts of mem at --gpu-memory-utilization 0.97
#   memhost  the 8B AWQ starts of mem with --offload-embedding (its embedding in pinned host memory)
#   large    bench.py --num-seqs 1024 --kv-cache-dtype fp8 for the three (targets 1.25x / 0.95x bf16; ~70-95 s each)
#   profile  bench.py --profile-decode / --profile-mixed for the three: where a batch-1 and a large step's time goes
#   sweep    bench_quant_kernels.py --sweep-w4: the 4-bit decode tiles at 1-16 rows (~2 min); prints the
#            W4_DECODE_TILES its winners make (nanovllm/kernels/quant_plans.py)
#   head     the int8 LM head (--quantize-lm-head int8) alone at the head's shape against bf16, 1-2 rows, then
#            batch 1 of qwen3-8b-awq with it (against batch1's runs without)
#
#   bash benchmarks/gpu_quant.sh                      # kernels batch1 mem large, within 480 s
#   bash benchmarks/gpu_quant.sh profile              # the kernel profiles (~3 min)
#   bash benchmarks/gpu_quant.sh batch1 large         # only these parts (a ratio's two sides run in one part)
#   GPU_QUANT_BUDGET_S=420 bash benchmarks/gpu_quant.sh   # a tighter budget: later steps are skipped
#
# Each step runs under its own timeout and a failing step does not stop the others; a step that would start
# past the budget is skipped and says so. Logs go to $OUT/gpu_quant (or /tmp/gpu_quant) and a compact summary
# is printed at the end.
set -u
cd "$(dirname "$0")/.."
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(kernels batch1 mem large)
BUDGET_S=${GPU_QUANT_BUDGET_S:-480}
LOG_DIR=${OUT:-/tmp}/gpu_quant
mkdir -p "$LOG_DIR"
START=$(date +%s)
SUMMARY=()

# step NAME TIMEOUT_S COMMAND...: run it if the budget allows, log to $LOG_DIR/NAME.log, note its status
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - ($(date +%s) - START)))
  if [ "$left" -lt 20 ]; then
    SUMMARY+=("$name: SKIPPED (budget of ${BUDGET_S} s spent)")
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "### $name (timeout ${limit} s): $*" | tee "$LOG_DIR/$name.log"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >>"$LOG_DIR/$name.log" 2>&1
  local rc=$?
  tail -n 60 "$LOG_DIR/$name.log"
  SUMMARY+=("$name: rc=$rc in $(($(date +%s) - t0)) s")
}

# the lines of a bench.py log that the summary keeps
bench_lines() {
  grep -hE "memory GiB|Throughput|decode steps read|wall time in decode|GPU time in decode|Error|error:" "$1" \
    | sed 's/^/    /' | cut -c1-230
}

for part in "${PARTS[@]}"; do
  case $part in
    kernels)
      step kernels 60 python benchmarks/bench_quant_kernels.py --m 1 2 16 64 1024 --budget-s 35 \
        --variants bf16 w4 fp8blk fp8blk-tri \
        --json "$LOG_DIR/kernels.json" ;;
    batch1)
      for shape in qwen3-8b qwen3-8b-fp8 qwen3-8b-awq; do
        step "batch1-$shape" 60 python bench.py --shape "$shape" --num-seqs 1 --max-num-seqs 16
      done ;;
    mem)
      step mem-qwen3-8b-awq 60 python bench.py --shape qwen3-8b-awq --gpu-memory-gib 8 --max-num-seqs 256 \
        --num-seqs 16 --kv-cache-dtype fp8
      step mem-qwen3-8b-awq-int8head 60 python bench.py --shape qwen3-8b-awq --gpu-memory-gib 8 \
        --max-num-seqs 256 --num-seqs 16 --kv-cache-dtype fp8 --quantize-lm-head int8
      step mem-qwen3-4b-fp8 60 python bench.py --shape qwen3-4b-fp8 --gpu-memory-gib 8 --max-num-seqs 256 \
        --num-seqs 16 --kv-cache-dtype fp8
      # the tied 4B embedding (0.72 GiB in bf16) in int8 too
      step mem-qwen3-4b-fp8-int8head 60 python bench.py --shape qwen3-4b-fp8 --gpu-memory-gib 8 \
        --max-num-seqs 256 --num-seqs 16 --kv-cache-dtype fp8 --quantize-lm-head int8
      # where the activation peak sits: a half-size profile step halves the MLP's [tokens, 2 x intermediate]
      # output (the expected peak) but not the sampler's 256 x vocabulary rows
      step mem-qwen3-8b-awq-int8head-4096 60 python bench.py --shape qwen3-8b-awq --gpu-memory-gib 8 \
        --max-num-seqs 256 --num-seqs 16 --kv-cache-dtype fp8 --quantize-lm-head int8 --max-num-batched-tokens 4096 ;;
    mem97)
      # the int8-head starts again with gpu_memory_utilization 0.97: the 10% headroom at 0.9 is 0.8 GiB of 8
      for shape in qwen3-8b-awq qwen3-4b-fp8; do
        step "mem97-$shape-int8head" 60 python bench.py --shape "$shape" --gpu-memory-gib 8 --max-num-seqs 256 \
          --num-seqs 16 --kv-cache-dtype fp8 --quantize-lm-head int8 --gpu-memory-utilization 0.97
      done ;;
    memhost)
      # the untied 8B's embedding in pinned host memory (offload_embedding), at 0.9, with and without the int8
      # head: the KV each gains over mem's same starts, and their tok/s beside them (what the gather costs)
      step memhost-qwen3-8b-awq 60 python bench.py --shape qwen3-8b-awq --gpu-memory-gib 8 --max-num-seqs 256 \
        --num-seqs 16 --kv-cache-dtype fp8 --offload-embedding
      step memhost-qwen3-8b-awq-int8head 60 python bench.py --shape qwen3-8b-awq --gpu-memory-gib 8 \
        --max-num-seqs 256 --num-seqs 16 --kv-cache-dtype fp8 --quantize-lm-head int8 --offload-embedding ;;
    profile)
      # batch 1 (where each kernel's share of a 4-6 ms step shows), then the large steps of the 1,024-sequence run
      for shape in qwen3-8b qwen3-8b-fp8 qwen3-8b-awq; do
        step "profile-$shape" 90 python bench.py --shape "$shape" --kv-cache-dtype fp8 --skip-run \
          --profile-decode 1:1000 1024:1000 --profile-mixed 0:8192
      done ;;
    head)
      step head-kernel 60 python benchmarks/bench_quant_kernels.py --shapes head --m 1 2 --budget-s 30 \
        --variants bf16 w8head --json "$LOG_DIR/head.json"
      step "batch1-qwen3-8b-awq-int8head" 60 python bench.py --shape qwen3-8b-awq --num-seqs 1 --max-num-seqs 16 \
        --quantize-lm-head int8 ;;
    sweep)
      step sweep 200 python benchmarks/bench_quant_kernels.py --sweep-w4 --budget-s 100 --json "$LOG_DIR/w4_sweep.json" ;;
    large)
      for shape in qwen3-8b qwen3-8b-fp8 qwen3-8b-awq; do
        step "large-$shape" 120 python bench.py --shape "$shape" --num-seqs 1024 --kv-cache-dtype fp8
      done ;;
    *)
      SUMMARY+=("$part: unknown part (kernels batch1 mem mem97 memhost profile large sweep head)") ;;
  esac
done

echo
echo "################ summary (logs in $LOG_DIR; $(($(date +%s) - START)) s) ################"
for line in "${SUMMARY[@]}"; do
  echo "$line"
  name=${line%%:*}
  log="$LOG_DIR/$name.log"
  [ -f "$log" ] || continue
  case $name in
    kernels|head-kernel) sed -n '/^copy bandwidth/,/^max |y/p' "$log" | head -n 80 | cut -c1-260; grep -h "^ERR" "$log" ;;
    head)
      step head-kernel 60 python benchmarks/bench_quant_kernels.py --shapes head --m 1 2 --budget-s 30 \
        --variants bf16 w8head --json "$LOG_DIR/head.json"
      step "batch1-qwen3-8b-awq-int8head" 60 python bench.py --shape qwen3-8b-awq --num-seqs 1 --max-num-seqs 16 \
        --quantize-lm-head int8 ;;
    sweep) tail -n 60 "$log" | cut -c1-260 ;;
    profile-*) grep -hE "ms per step back to back" "$log" ;;
    *) bench_lines "$log" ;;
  esac
done

# tok/s against bf16, per part that ran all three shapes in this command
for part in batch1 large; do
  base=$(grep -ho "Throughput: [0-9]*" "$LOG_DIR/$part-qwen3-8b.log" 2>/dev/null | awk '{print $2}')
  [ -n "$base" ] || continue
  for shape in qwen3-8b-fp8 qwen3-8b-awq qwen3-8b-awq-int8head; do
    tok=$(grep -ho "Throughput: [0-9]*" "$LOG_DIR/$part-$shape.log" 2>/dev/null | awk '{print $2}')
    [ -n "$tok" ] && echo "$part $shape: $tok tok/s = $(awk -v a="$tok" -v b="$base" 'BEGIN{printf "%.2f", a / b}')x bf16 ($base)"
  done
done
