#!/usr/bin/env bash
# GPU check of kvedit's Triton kernels, for a machine with CUDA and no network:
#   1. the kernel tests with TRITON_INTERPRET unset (compiled kernels, real fp16/bf16 math);
#   2. the runtime seam on CUDA (python -m benchmarks.gpu_seam_check: unsteered bit-identical,
#      continuation through the Triton kernel, gpt-oss sinks);
#   3. the attention benchmark (--quick unless --full is given: 1K, 4K, 16K, 32K), with its
#      PASS/MISS targets; with --sweep also the launch-config sweep and the one-pass/split-K
#      decode threshold (kvedit/triton/configs.py takes its numbers from there);
#   4. the end-to-end benchmark (python -m benchmarks.gpu_e2e: 8B- and 4B-shaped models, 4K and
#      16K, unsteered / steer / captured state + edit);
#   5. focus's two answers as one batch of two against one after the other (python -m
#      benchmarks.decode_pair: an 8B-shaped model, 4K tokens).
# Everything lands in "${OUT:-runs/gpu_<gpu>_<date>}": gpu_env.txt,
# triton_tests.log/.xml, seam_check.log/.json, attention_bench.log/.json, e2e.log/.json,
# decode_pair.log/.json.
# Budget: under 7 minutes in all (quick; each step has its own timeout; --sweep adds about 1).
# --cpu checks the script itself on a machine without a GPU: the same steps through Triton's
# interpreter (TRITON_INTERPRET=1), the benchmarks at tiny shapes (--cpu-smoke, --tiny); its
# timings mean nothing.
#
# Usage: benchmarks/gpu_check.sh [--full] [--sweep] [--cpu]   (PYTHON=... to pick the interpreter)
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
py="${PYTHON:-python3}"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
    | tr 'A-Z' 'a-z' | sed 's/nvidia//; s/[^a-z0-9]\+/_/g; s/^_//; s/_$//')
full=0
sweep=0
cpu=0
for arg in "$@"; do
    case "$arg" in
        --full) full=1 ;;
        --sweep) sweep=1 ;;
        --cpu) cpu=1 ;;
        *) echo "unknown argument: $arg" >&2; exit 2 ;;
    esac
done
bench_args=(--quick)
bench_limit=70
tests_limit=130
seam_limit=40
e2e_limit=110
e2e_args=()
pair_limit=60
pair_args=(--shape llama3-8b --tokens 4096)
if ((full)); then bench_args=(); bench_limit=540; fi
if ((sweep)); then bench_args+=(--sweep); bench_limit=$((bench_limit + 60)); fi
if ((cpu)); then
    gpu=cpu
    # the interpreter is slow (the kernel tests take about 2 minutes on 2 cores)
    tests_limit=600 seam_limit=120 e2e_limit=300 bench_limit=$((bench_limit + 230))
    export TRITON_INTERPRET=1
    bench_args+=(--cpu-smoke)
    e2e_args+=(--tiny)
    pair_limit=120 pair_args=(--shape tiny-llama3-8b --tokens 200 --steps 4 --repeats 1)
else
    unset TRITON_INTERPRET
fi
out_dir="${OUT:-runs/gpu_${gpu:-unknown}_$(date -u +%Y-%m-%d)}"
mkdir -p "$out_dir"
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
timeout "$tests_limit" "$py" -m pytest -q -p no:cacheprovider \
    tests/triton/test_triton_attention.py tests/triton/test_triton_rerotate.py tests/triton/test_triton_decode.py \
    tests/triton/test_triton_configs.py \
    --junitxml="$out_dir/triton_tests.xml" 2>&1 | tee "$out_dir/triton_tests.log"
tests_rc=${PIPESTATUS[0]}
echo "tests: exit $tests_rc after $((SECONDS - start)) s" | tee -a "$out_dir/triton_tests.log"

start=$SECONDS
timeout "$seam_limit" "$py" -m benchmarks.gpu_seam_check --json "$out_dir/seam_check.json" 2>&1 \
    | tee "$out_dir/seam_check.log"
seam_rc=${PIPESTATUS[0]}
echo "seam check: exit $seam_rc after $((SECONDS - start)) s" | tee -a "$out_dir/seam_check.log"

start=$SECONDS
timeout "$bench_limit" "$py" -m benchmarks.attention "${bench_args[@]}" \
    --out "$out_dir/attention_bench.json" 2>&1 | tee "$out_dir/attention_bench.log"
bench_rc=${PIPESTATUS[0]}
echo "benchmark: exit $bench_rc after $((SECONDS - start)) s" | tee -a "$out_dir/attention_bench.log"

start=$SECONDS
timeout "$e2e_limit" "$py" -m benchmarks.gpu_e2e "${e2e_args[@]}" --json "$out_dir/e2e.json" 2>&1 | tee "$out_dir/e2e.log"
e2e_rc=${PIPESTATUS[0]}
echo "end to end: exit $e2e_rc after $((SECONDS - start)) s" | tee -a "$out_dir/e2e.log"

start=$SECONDS
timeout "$pair_limit" "$py" -m benchmarks.decode_pair "${pair_args[@]}" --out "$out_dir/decode_pair.json" 2>&1 \
    | tee "$out_dir/decode_pair.log"
pair_rc=${PIPESTATUS[0]}
echo "decode pair: exit $pair_rc after $((SECONDS - start)) s" | tee -a "$out_dir/decode_pair.log"

echo "gpu_check: tests $tests_rc, seam $seam_rc, kernel bench $bench_rc, e2e $e2e_rc, pair $pair_rc; results in $out_dir"
[[ $tests_rc -eq 0 && $seam_rc -eq 0 && $bench_rc -eq 0 && $e2e_rc -eq 0 && $pair_rc -eq 0 ]]
