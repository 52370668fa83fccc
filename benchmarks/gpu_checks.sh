#!/usr/bin/env bash
# Every GPU check, in one call of a lent GPU machine (its lease is minutes: docs/results/gpu.md):
#
#     bash benchmarks/gpu_checks.sh [STEP...]   # steps: bandwidth overhead overhead_quick overhead_tiny overhead_large
#                                               # overhead_m16 overhead_combo profile compile kernel_tests
#                                               # gpu_tests suite
#                                               # (default: bandwidth overhead gpu_tests); logs and reports
#                                               # under $OUT
#
# Runs under the machine's own python3 (PYTHON=... to change) after an editable install without
# dependencies (the backend's entry point needs it). Each step has a time limit, so one that hangs
# leaves the others their time; each step's log and report land in $OUT (default ./gpu_out). The
# overhead steps run 2 runs (one made in each order: benchmarks/overhead.py), each compiling afresh;
# each model's ratios are in the step's log as soon as they are measured, so a step cut short by its
# limit still says what it measured.
set -u
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

step() {  # step NAME LIMIT_S COMMAND...: run it under a time limit, log to $out/NAME.log, print its tail
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc in $((SECONDS - start)) s (limit $limit s)"
  tail -n "${TAIL:-12}" "$out/$name.log"
  grep -E "^(\[gw[0-9]+\] .*)?(FAILED|ERROR) " "$out/$name.log" | head -n 20
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  "$py" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__,
            'triton', triton.__version__, torch.cuda.get_device_name())"
  echo "cpus $(nproc)"
  "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e . && echo "installed autoscale (editable)"
} >"$out/env.log" 2>&1
cat "$out/env.log"
grep -q "installed autoscale" "$out/env.log" || exit 1

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(bandwidth overhead gpu_tests)
for name in "${steps[@]}"; do
    case $name in
    bandwidth)
        step bandwidth 90 "$py" -m benchmarks.kernel_bandwidth --sweep
        cp docs/results/kernels.md "$out/" ;;
    overhead)
        step overhead 540 "$py" -m benchmarks.overhead --device cuda --runs 2
        cp docs/results/overhead_cuda.md "$out/" 2>/dev/null ;;
    overhead_quick)
        step overhead_quick 300 "$py" -m benchmarks.overhead --device cuda --quick --runs 2
        cp docs/results/overhead_quick_cuda.md "$out/" 2>/dev/null ;;
    overhead_tiny)  # models whose arithmetic is negligible: what a step costs besides it, launches included
        step overhead_tiny 300 "$py" -m benchmarks.overhead --device cuda --tiny --runs 2
        cp docs/results/overhead_tiny_cuda.md "$out/" 2>/dev/null ;;
    overhead_large)  # models whose steps the GPU's arithmetic bounds (benchmarks.overhead --large)
        step overhead_large 420 "$py" -m benchmarks.overhead --device cuda --large --runs 2
        cp docs/results/overhead_large_cuda.md "$out/" 2>/dev/null ;;
    overhead_m16)  # (a) and (a') measuring every 16th step only (ScalingConfig.measure_every), beside
                   # (a1), measuring every step
        step overhead_m16 420 "$py" -m benchmarks.overhead --device cuda --runs 2 --measure-every 16 \
            -o "$out/overhead_m16_cuda.md" ;;
    overhead_combo)  # every method with Inductor's combo kernels (independent kernels in one launch)
        step overhead_combo 240 "$py" -m benchmarks.overhead --device cuda --runs 2 --inductor combo_kernels=True \
            -o "$out/overhead_combo_cuda.md" ;;
    profile)  # the CNN too: its launches against benchmarks.kernel_counts' (a GPU's layout, NCHW)
        step profile 150 "$py" -m benchmarks.step_profile --device cuda --steps 3 --models MLP CNN "transformer block"
        cp docs/results/step_profile_cuda.md "$out/" 2>/dev/null ;;
    compile)  # cold and warm compile times against torch.compile + autocast (benchmarks.compile_time)
        step compile 420 "$py" -m benchmarks.compile_time --end-to-end --device cuda \
            --models "T5 3+3" "transformer block (overhead --quick)"
        cp docs/results/compile_time_models_cuda.md "$out/" 2>/dev/null ;;
    kernel_tests)  # the kernel's tests alone, run natively
        step kernel_tests 60 "$py" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/kernels ;;
    gpu_tests)  # the GPU-marked tests, and the kernels' tests run natively
        step gpu_tests 180 bash -c "'$py' -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/kernels;
                                    '$py' -m pytest -q -p no:cacheprovider -m gpu tests" ;;
    suite)  # the default suite, spread over the machine's cores; -v names each failure as it
            # happens, so a run cut short by its limit still says which tests failed
        step suite "${SUITE_S:-300}" "$py" -m pytest -v -p no:cacheprovider -m "not slow" -n 16 ;;
    *) echo "unknown step $name"; exit 2 ;;
    esac
done
