#!/usr/bin/env bash
# One command for the GPU checks of paged-ops (written for an H200: torch 2.11, triton 3.6, no network).
#
#   bash bench/device_check.sh
#
# With a GPU: build with the CUDA kernels (arch 90), run the CUDA/Triton GPU tests (the #13 variant,
# merge and batch-invariant tests of test_cuda_gpu.py and test_cuda_prefill_variants.py included), the GPU-only
# device checks (tests/test_cuda_device_checks.py: odd-offset cache views, tensor-core prefill at head
# sizes 8/24/136/200, fp8 with head 24, one real cache over 2^31 elements, the kernel-bug regressions),
# compute-sanitizer memcheck over the CUDA tests and racecheck + synccheck over the shared-KV decode
# and tensor-core prefill tests, the engine's end-to-end tests on the GPU, then the GPU kernel
# benchmarks (decode 32 seqs x 8k tokens, 32/8 heads, d128, bf16 block sweep; cuda and triton vs
# device copy bandwidth, bf16 matmul, FlexAttention paged decode; prefill vs SDPA flash) and the
# attention-variant benchmarks (bench/variants.py: sliding-window decode, batch-invariant cost). Without a
# GPU: the small CPU benchmarks only.
# Every step has a time limit (BUILD_S 150 + TESTS_S 50 + VARIANTS_TESTS_S 40 + CONTRACT_S 80 + DEVICE_S 30
# + MEMCHECK_S 35 + RACECHECK_S 30 + SYNCCHECK_S 20 + ENGINE_S 25 + VARIANTS_S 40 + BENCH_S 55 = 555 s:
# inside one 10-minute device command; the limits are budgets, not measurements: no step has run on a
# GPU yet); results (JSON, PNG) and logs go to
# bench/results/device-check-<UTC time>/ and
# are copied to $OUT when it is set. Exit status: non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
LOGS=bench/results/device-check-$STAMP
mkdir -p "$LOGS"
SUMMARY=()
FAILED=0

# step NAME SECONDS CMD...: run CMD under a time limit, log to $LOGS/NAME.log, show its tail.
step() {
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS rc
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=15 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    # a benchmark's own summary if it printed one, else the log's tail
    if grep -q "paged-ops bench:" "$LOGS/$name.log"; then
        sed -n '/paged-ops bench:/,/^plot:/p' "$LOGS/$name.log"
    else
        tail -n 25 "$LOGS/$name.log"
    fi
    local verdict=ok
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="TIMEOUT"; FAILED=1
    elif [ $rc -ne 0 ]; then verdict="FAILED rc=$rc"; FAILED=1; fi
    SUMMARY+=("$(printf '%-16s %-14s %5ss  %s' "$name" "$verdict" $((SECONDS - t0)) "$LOGS/$name.log")")
}

if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    "$PY" -c "import torch; print('GPU:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
    export PAGED_OPS_CUDA=on PAGED_OPS_CUDA_ARCHS=${PAGED_OPS_CUDA_ARCHS:-90} TRITON_INTERPRET=0
    # no network on the device machine: build with what is installed, fetch nothing
    step build "${BUILD_S:-150}" "$PY" -m pip install -q --no-build-isolation --no-deps -e .
    GPU_TESTS=$(ls tests/test_cuda_gpu.py tests/test_triton.py 2>/dev/null)
    step gpu-tests "${TESTS_S:-50}" "$PY" -m pytest -q -x -p no:cacheprovider $GPU_TESTS
    # the attention variants of #13 in both CUDA prefill kernels on the GPU (tensor-core mma.sync,
    # tanhf/exp2f), the GPU targets of the emulator-and-GPU suite (its emulator cases run in make test)
    step gpu-variants "${VARIANTS_TESTS_S:-40}" "$PY" -m pytest -q -p no:cacheprovider \
        tests/test_cuda_prefill_variants.py -k "[cuda:"
    # the op contract on CUDA tensors: tests/test_ops.py's cuda and triton cases (its cpu and
    # cuda_emu cases run in `make test`)
    step gpu-contract "${CONTRACT_S:-80}" "$PY" -m pytest -q -p no:cacheprovider tests/test_ops.py \
        -k "[cuda- or [cuda] or [triton- or [triton]"
    # what the emulator cannot prove: vector widths on odd views, padded tensor-core head sizes, a
    # cache past 2^31 elements (2 x 5.4 GB), the kernel-bug regressions on the GPU kernels
    step device-checks "${DEVICE_S:-30}" "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_device_checks.py
    if command -v compute-sanitizer >/dev/null; then
        # memcheck slows kernels ~100x: the CUDA tests' smaller cases only
        step memcheck "${MEMCHECK_S:-35}" compute-sanitizer --tool memcheck --error-exitcode 99 \
            --target-processes all "$PY" -m pytest -q -x -p no:cacheprovider tests/test_cuda_gpu.py \
            -k "${MEMCHECK_K:-decode or prefill or reshape or merge}" --maxfail=1
        # shared-memory hazards (racecheck) and barrier misuse (synccheck) in the two kernels that
        # stage through shared memory with barriers: the shared-KV decode (cp.async double buffer)
        # and the tensor-core prefill; the small cases of test_cuda_device_checks.py keep them inside
        # the limit
        for tool in racecheck synccheck; do
            limit=$([ $tool = racecheck ] && echo "${RACECHECK_S:-30}" || echo "${SYNCCHECK_S:-20}")
            step $tool "$limit" compute-sanitizer --tool $tool --error-exitcode 99 \
                --target-processes all "$PY" -m pytest -q -x -p no:cacheprovider tests/test_cuda_device_checks.py \
                -k sanitize --maxfail=1
        done
    else
        SUMMARY+=("$(printf '%-16s %-14s' sanitizers 'SKIPPED (no compute-sanitizer on PATH)')")
    fi
    # the engine picks CUDA when it is there: its greedy outputs against transformers' (CPU) generate
    step engine-gpu "${ENGINE_S:-25}" "$PY" -m pytest -q -x -p no:cacheprovider tests/test_engine_e2e.py
    # issue #13 on the GPU: decode at L = 4k/16k/64k with and without a 4096-key window (flat with
    # the window if the kernels skip the blocks before it), and the batch-invariant mode's cost
    step variants-bench "${VARIANTS_S:-40}" env PAGED_BENCH_RESULTS="$LOGS" "$PY" -m bench.variants \
        window batch-invariant --backends cuda,triton --save
    step kernel-bench "${BENCH_S:-55}" env PAGED_BENCH_PROFILE=gpu PAGED_BENCH_RESULTS="$LOGS" "$PY" -m pytest -q -p no:cacheprovider \
        bench/test_kernels.py bench/test_references.py --benchmark-enable
else
    echo "no GPU visible: CPU benchmarks only (small profile)"
    step kernel-bench-cpu "${BENCH_S:-300}" env PAGED_BENCH_PROFILE=cpu-small PAGED_BENCH_RESULTS="$LOGS" "$PY" -m pytest -q \
        -p no:cacheprovider bench/test_kernels.py --benchmark-enable
fi

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/bench-results"
    cp -r bench/results/. "$OUT/bench-results/"
fi

echo
echo "=== device check summary ($STAMP)"
printf '%s\n' "${SUMMARY[@]}"
grep -h "^headline\|GB/s = " "$LOGS"/kernel-bench*.log 2>/dev/null || true
exit $FAILED
