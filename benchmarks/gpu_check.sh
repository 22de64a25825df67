#!/usr/bin/env bash
# GPU check of kvedit's Triton kernels, for a machine with CUDA and no network:
#   1. the kernel tests with TRITON_INTERPRET unset (compiled kernels, real fp16/bf16 math);
#   2. the runtime seam on CUDA (benchmarks/gpu_seam_check.py: unsteered bit-identical, continuation
#      through the Triton kernel, gpt-oss sinks);
#   3. the attention benchmark (--quick unless --full is given), with its PASS/MISS targets.
# Everything lands in "${OUT:-/tmp}": gpu_env.txt, triton_tests.log, triton_tests.xml,
# seam_check.log, seam_check.json, attention_bench.log and attention_bench.json. Budget: about 5 minutes in all (quick).
#
# Usage: benchmarks/gpu_check.sh [--full] [--sweep]      (PYTHON=... to pick the interpreter)
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
out_dir="${OUT:-/tmp}"
py="${PYTHON:-python3}"
mkdir -p "$out_dir"

bench_args=(--quick)
bench_limit=120
for arg in "$@"; do
    case "$arg" in
        --full) bench_args=(); bench_limit=540 ;;
        --sweep) bench_args+=(--sweep); bench_limit=$((bench_limit + 60)) ;;
        *) echo "unknown argument: $arg" >&2; exit 2 ;;
    esac
done

unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
    "$py" -c 'import sys, torch, triton, transformers
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
} 2>&1 | tee "$out_dir/gpu_env.txt"

start=$SECONDS
timeout 160 "$py" -m pytest -q -p no:cacheprovider \
    tests/test_triton_attention.py tests/test_triton_rerotate.py \
    --junitxml="$out_dir/triton_tests.xml" 2>&1 | tee "$out_dir/triton_tests.log"
tests_rc=${PIPESTATUS[0]}
echo "tests: exit $tests_rc after $((SECONDS - start)) s" | tee -a "$out_dir/triton_tests.log"

start=$SECONDS
timeout 60 "$py" benchmarks/gpu_seam_check.py --json "$out_dir/seam_check.json" 2>&1 \
    | tee "$out_dir/seam_check.log"
seam_rc=${PIPESTATUS[0]}
echo "seam check: exit $seam_rc after $((SECONDS - start)) s" | tee -a "$out_dir/seam_check.log"

start=$SECONDS
timeout "$bench_limit" "$py" benchmarks/attention.py "${bench_args[@]}" \
    --out "$out_dir/attention_bench.json" 2>&1 | tee "$out_dir/attention_bench.log"
bench_rc=${PIPESTATUS[0]}
echo "benchmark: exit $bench_rc after $((SECONDS - start)) s" | tee -a "$out_dir/attention_bench.log"

[[ $tests_rc -eq 0 && $seam_rc -eq 0 && $bench_rc -eq 0 ]]
