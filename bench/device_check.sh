#!/usr/bin/env bash
# One command for the GPU checks of paged-ops, written for its one chance on a lent H200 (torch 2.11,
# triton 3.6, Python 3.12, no network, one 10-minute command):
#
#   bash bench/device_check.sh                 # everything below, within TOTAL_BUDGET_S
#   bash bench/device_check.sh --preflight F   # only the 5-second preflight (writes its findings to F)
#
# Through the device tool: one run of `bash bench/device_check.sh` with timeout_s 540 (the 480 s of
# steps, the per-step bookkeeping, slack), nothing carried: it builds there, from the copied tree.
#
# With a GPU, in this order (the headline's measurements before the long tests, so a short run still
# has them): a preflight of every tool and package used; the build (CUDA arch 90 only, without the
# emulator backend and the extra CPU ISA builds, which only the CPU machines test); the headline
# benchmark (bench/test_kernels.py, profile device-check: peaks of copy bandwidth and bf16 matmul,
# then cuda and triton on decode 64 x 4096 32/8 heads, decode batch 1 (split-KV), decode group 8 and
# prefill 8 x 2048, tuning bounded by BENCH_TUNE_S); the GPU tests (test_cuda_gpu.py, test_triton.py,
# the device checks of test_cuda_device_checks.py, the engine end to end); the torch references
# (FlexAttention paged decode, SDPA flash prefill) on the same shapes; the op contract on CUDA tensors
# (test_ops.py, test_cuda_prefill_variants.py's GPU targets); compute-sanitizer memcheck, racecheck,
# synccheck; the attention-variant benchmark (bench.variants); and last the headline table
# (bench/headline.py). Without a GPU: the preflight, the benchmarks at smoke size (CPU_PROFILE) and
# the table's frame, quick, to check the script itself.
#
# Every step runs under its own limit: at the limit it gets SIGINT (pytest then still writes what it
# measured), KILL_GRACE_S later SIGKILL. The limits and the grace are set in one place below; their
# sum must fit TOTAL_BUDGET_S or the script refuses to start. They are budgets, not measurements.
# As each step ends, its log and everything measured so far reach $OUT (when set; the device tool
# brings back at most 8 files, so it gets exactly these five):
#   summary.txt            each step: ok / FAILED rc=N / TIMEOUT / SKIPPED, seconds taken, limit
#   steps.log              every finished step's log (the last LOG_TAIL_LINES lines of each)
#   headline.txt/.json     the headline table as measured so far
#   device-check.tar.gz    the whole results folder: full logs, results JSON, plots, tuning.json,
#                          the build's .ninja_log (per-file compile times, for the next budgets)
# Results stay in bench/results/device-check-<UTC time>/. Exit status: non-zero if a step failed or
# timed out.
set -uo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."

# ---- budgets: the one place the steps' limits are set (seconds; each overridable by its variable) ---
TOTAL_BUDGET_S=480   # of the device command's 600 s; the rest for its start, copies and slack
KILL_GRACE_S=${KILL_GRACE_S:-5}
# name:limit, in run order. A limit of 0 skips the step (and costs no grace): issue #13's variants
# benchmark gets none by default. The build's limit is sized from ninja's longest job, nvcc of the
# largest kernel file for sm_90 (one process each; the rest of the build is spread over 16 cores),
# with half as much again and the configure step on top: an estimate until the first run's
# .ninja_log comes back.
# A skipped step (no compute-sanitizer, a failed build) costs nothing.
GPU_PLAN="preflight:${PREFLIGHT_S:-5} build:${BUILD_S:-160} bench-kernels:${BENCH_KERNELS_S:-70}
 gpu-tests:${GPU_TESTS_S:-60} bench-references:${BENCH_REFERENCES_S:-40} gpu-contract:${GPU_CONTRACT_S:-35}
 memcheck:${MEMCHECK_S:-25} racecheck:${RACECHECK_S:-12} synccheck:${SYNCCHECK_S:-10}
 variants-bench:${VARIANTS_BENCH_S:-0} headline:${HEADLINE_S:-3}"
CPU_PLAN="preflight:${PREFLIGHT_S:-5} kernel-bench-cpu:${BENCH_CPU_S:-150} headline:${HEADLINE_S:-3}"
# Seconds each backend may spend tuning in the headline benchmark (bench/kernels.py tune:
# PAGED_BENCH_TUNE_S); the tests and the variants benchmark tune nothing (PAGED_OPS_AUTOTUNE=0:
# the kernels' defaults).
BENCH_TUNE_S=${BENCH_TUNE_S:-30}
LOG_TAIL_LINES=${LOG_TAIL_LINES:-400}

if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

# ---- the preflight: every tool and package, one line each, in parallel, inside 5 seconds -----------
# Each probe has its own limit (PROBE_S, 1.5 s under the step's, which the bookkeeping after the
# probes needs), so one hanging tool costs only itself.
# Writes KEY=VALUE lines to the file named (sourced by the main run): what the later steps may use.
preflight() {
    local envfile=$1 dir probe_s=${PROBE_S:-3.5}
    dir=$(mktemp -d)
    # probe NAME KIND(required|optional: what is lost) CMD...: one line, the tool's first output line
    probe() {
        local name=$1 kind=$2; shift 2
        local out rc
        if ! command -v "$1" >/dev/null 2>&1; then
            echo "MISSING $kind" >"$dir/$name"; return
        fi
        timeout -k 1 "$probe_s" "$@" >"$dir/$name.out" 2>&1; rc=$?
        # the line that names the version (nvcc's and compute-sanitizer's first lines do not)
        out=$(grep -m1 -iE 'release|version|^GPU [0-9]' "$dir/$name.out" || grep -m1 -v '^\s*$' "$dir/$name.out")
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo "TIMEOUT after ${probe_s}s ($kind)" >"$dir/$name"
        elif [ "$rc" -ne 0 ]; then echo "FAILED rc=$rc: ${out:0:100} ($kind)" >"$dir/$name"
        else echo "ok: ${out:0:100}" >"$dir/$name"; fi
    }
    probe nvcc required nvcc --version &
    probe compute-sanitizer "optional: memcheck, racecheck, synccheck skipped" compute-sanitizer --version &
    probe cuobjdump "optional: python -m bench.sass" cuobjdump --version &
    probe nvidia-smi "optional: the GPU's name, GPU detection without torch" nvidia-smi -L &
    probe cmake required cmake --version &
    probe ninja required ninja --version &
    # One Python: versions from the package metadata (no imports: transformers alone takes seconds),
    # then torch, whose import and CUDA query are the slow part; printed last so the rest survives.
    timeout -k 1 "$probe_s" "$PY" -c '
import importlib.metadata as md, platform, sys
print("python", platform.python_version(), sys.executable, flush=True)
for dist in ("triton", "pytest", "pytest-benchmark", "hypothesis", "transformers", "pytest-xdist",
             "scikit-build-core", "matplotlib"):
    try:
        v = md.version(dist)
    except md.PackageNotFoundError:
        v = "-"
    print("pkg", dist, v, flush=True)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda or "-", "gpus", torch.cuda.device_count()
      if torch.cuda.is_available() else 0, flush=True)
' >"$dir/python" 2>"$dir/python.err" &
    wait
    local line name ver status kind missing="" gpus="" torch_line
    while read -r name; do
        echo "preflight: $(printf '%-18s' "$name") $(cat "$dir/$name")"
        case "$(cat "$dir/$name")" in "MISSING required"*|"TIMEOUT"*"(required)"|"FAILED"*"(required)") missing+=" $name";; esac
    done < <(printf '%s\n' nvcc cmake ninja compute-sanitizer cuobjdump nvidia-smi)
    echo "preflight: $(printf '%-18s' python) $(sed -n 's/^python //p' "$dir/python" || true)"
    for dist in triton pytest pytest-benchmark hypothesis transformers pytest-xdist scikit-build-core matplotlib; do
        ver=$(awk -v d="$dist" '$1 == "pkg" && $2 == d {print $3}' "$dir/python")
        case $dist in
            transformers) kind="optional: the engine's end-to-end test skipped";;
            pytest-xdist) kind="optional: the tests run in one process";;
            matplotlib) kind="optional: no plots (the benchmark's results file needs it)";;
            *) kind=required;;
        esac
        if [ -z "$ver" ]; then status="UNKNOWN (the Python probe did not get this far) ($kind)"
        elif [ "$ver" = "-" ]; then status="MISSING $kind"
            [ "$kind" = required ] && missing+=" $dist"
        else status="ok: $ver"; fi
        echo "preflight: $(printf '%-18s' "$dist") $status"
        echo "HAVE_$(echo "$dist" | tr 'a-z-' 'A-Z_')=$([ "${ver:--}" != - ] && echo 1 || echo 0)" >>"$envfile"
    done
    torch_line=$(grep '^torch ' "$dir/python" || true)
    if [ -n "$torch_line" ]; then
        gpus=$(echo "$torch_line" | awk '{print $NF}')
        echo "preflight: $(printf '%-18s' torch) ok: $torch_line"
    else
        echo "preflight: $(printf '%-18s' torch) NOT ANSWERED within ${probe_s}s: $(tail -n1 "$dir/python.err" 2>/dev/null)"
    fi
    {
        echo "TORCH_GPUS=$gpus"
        echo "HAVE_SANITIZER=$(grep -q '^ok' "$dir/compute-sanitizer" && echo 1 || echo 0)"
        echo "NVIDIA_SMI_GPUS=$(grep -q '^ok: GPU' "$dir/nvidia-smi" && echo 1 || echo 0)"
        echo "PREFLIGHT_MISSING='${missing# }'"
    } >>"$envfile"
    rm -rf "$dir"
    if [ -n "$missing" ]; then echo "preflight: required but missing or broken:$missing"; return 1; fi
}

if [ "${1:-}" = "--preflight" ]; then
    : >"${2:?--preflight needs the file to write its findings to}"
    preflight "$2"
    exit $?
fi

# ---- the budget check: refuse to start a run that could outlast its share of the command -----------
plan_total() {  # plan_total PLAN: the sum of its limits and one kill grace per step run
    local total=0 entry
    for entry in $1; do [ "${entry#*:}" -gt 0 ] && total=$((total + ${entry#*:} + KILL_GRACE_S)); done
    echo $total
}
for plan_name in GPU_PLAN CPU_PLAN; do
    for entry in ${!plan_name}; do
        case ${entry#*:} in ''|*[!0-9]*) echo "device check: budget '$entry' in $plan_name is not whole seconds" >&2; exit 2;; esac
    done
    total=$(plan_total "${!plan_name}")
    if [ "$total" -gt "$TOTAL_BUDGET_S" ]; then
        echo "device check: refusing to start: $plan_name needs $total s (limits + ${KILL_GRACE_S} s grace per step)," \
             "over TOTAL_BUDGET_S $TOTAL_BUDGET_S s: $(echo ${!plan_name})" >&2
        exit 2
    fi
done

STAMP=$(date -u +%Y%m%dT%H%M%SZ)
LOGS=bench/results/device-check-$STAMP
mkdir -p "$LOGS"
[ -n "${OUT:-}" ] && mkdir -p "$OUT"
# the tuner's one file for every step of this run (and it comes back in the tarball)
export PAGED_OPS_CACHE_DIR="$PWD/$LOGS/tuning-cache" PYTHONUNBUFFERED=1
PLAN=$GPU_PLAN   # until the preflight says otherwise: its summary lists the GPU's steps as pending
STEP_NAMES=() STEP_STATE=() STEP_TOOK=()
FAILED=0
# the device machine gets a copy of the working tree, maybe without .git
if COMMIT=$(git rev-parse --short HEAD 2>/dev/null); then
    git diff --quiet HEAD -- 2>/dev/null || COMMIT+=" (working tree modified)"
else
    COMMIT="? (no git)"
fi

limit_of() { local entry; for entry in $PLAN; do [ "${entry%%:*}" = "$1" ] && { echo "${entry#*:}"; return; }; done; echo 0; }

write_summary() {
    local f="$LOGS/summary.txt" entry name i state took
    {
        echo "paged-ops device check $STAMP, commit $COMMIT, ${MODE:-starting}"
        echo "budget: $(plan_total "$PLAN") s of $TOTAL_BUDGET_S (limits + ${KILL_GRACE_S} s grace per step); elapsed $SECONDS s"
        printf '%-17s %-40s %6s %6s\n' step verdict took limit
        for entry in $PLAN; do
            name=${entry%%:*} state=pending took=""
            for i in "${!STEP_NAMES[@]}"; do
                [ "${STEP_NAMES[$i]}" = "$name" ] && { state=${STEP_STATE[$i]}; took=${STEP_TOOK[$i]}; }
            done
            printf '%-17s %-40s %6s %6s\n' "$name" "$state" "$took" "${entry#*:}s"
        done
    } >"$f"
    publish_file "$f" summary.txt
}

# publish_file SRC NAME: SRC to $OUT/NAME whole or not at all (the tool may collect $OUT at any time)
publish_file() {
    [ -n "${OUT:-}" ] || return 0
    cp "$1" "$OUT/$2.part" && mv -f "$OUT/$2.part" "$OUT/$2"
}

publish_step() {  # after each step: its log, the summary, the table so far, the whole folder
    local name=$1
    if [ -n "${OUT:-}" ]; then
        { echo "=== $name: ${STEP_STATE[-1]} (${STEP_TOOK[-1]}, limit $(limit_of "$name")s); last $LOG_TAIL_LINES lines of $name.log"
          tail -n "$LOG_TAIL_LINES" "$LOGS/$name.log" 2>/dev/null; echo; } >>"$OUT/steps.log"
    fi
    write_summary
    if [ "$name" = headline ]; then
        cp "$LOGS/headline.log" "$LOGS/headline.txt"
    elif compgen -G "$LOGS/*.json" >/dev/null; then  # the table so far (a render takes no torch)
        timeout 3 "$PY" -m bench.headline "$LOGS" --json "$LOGS/headline.json" >"$LOGS/headline.txt" 2>&1 || true
    fi
    if [ -n "${OUT:-}" ]; then
        [ -s "$LOGS/headline.txt" ] && publish_file "$LOGS/headline.txt" headline.txt
        [ -s "$LOGS/headline.json" ] && publish_file "$LOGS/headline.json" headline.json
        tar -czf "$OUT/device-check.tar.gz.part" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" 2>/dev/null &&
            mv -f "$OUT/device-check.tar.gz.part" "$OUT/device-check.tar.gz"
    fi
}

finish_step() {  # finish_step NAME VERDICT TOOK
    STEP_NAMES+=("$1") STEP_STATE+=("$2") STEP_TOOK+=("$3")
    publish_step "$1"
}

skip() {  # skip NAME WHY: a step not run, in the summary with its reason
    echo "=== $1: SKIPPED ($2)"
    echo "SKIPPED: $2" >"$LOGS/$1.log"
    finish_step "$1" "SKIPPED ($2)" "0s"
}

# step NAME CMD...: CMD under NAME's limit (SIGINT, then SIGKILL after the grace), logged to
# $LOGS/NAME.log; its tail shown; the summary and $OUT updated as soon as it ends.
step() {
    local name=$1; shift
    local limit t0=$SECONDS rc verdict
    limit=$(limit_of "$name")
    if [ "$limit" -eq 0 ]; then skip "$name" "limit 0 s in this run's plan"; return 1; fi
    echo "=== $name (limit ${limit}s): $*"
    STEP_NAMES+=("$name") STEP_STATE+=("RUNNING since ${SECONDS}s") STEP_TOOK+=("")
    write_summary
    unset 'STEP_NAMES[-1]' 'STEP_STATE[-1]' 'STEP_TOOK[-1]'
    # SIGINT: Python's KeyboardInterrupt, after which pytest still prints its summary and
    # bench/conftest.py writes the rows measured (timeout handles INT itself, so the command gets it
    # with the default action even where this shell was started with INT ignored)
    DEVICE_CHECK_STEP=$name timeout --signal=INT --kill-after="$KILL_GRACE_S" "$limit" \
        "$@" >"$LOGS/$name.log" 2>&1 </dev/null
    rc=$?
    if grep -q "paged-ops bench:" "$LOGS/$name.log"; then  # a benchmark's own summary if it printed one
        sed -n '/paged-ops bench:/,/^plot:/p' "$LOGS/$name.log" | head -n 60
    else
        tail -n 15 "$LOGS/$name.log"
    fi
    verdict=ok
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="TIMEOUT"; FAILED=1
    elif grep -q "Device not supported" "$LOGS/$name.log" && [[ $name == *check ]]; then
        verdict="UNSUPPORTED (compute-sanitizer: device)"  # seen on gVisor machines: not the code's failure
    elif [ $rc -ne 0 ]; then verdict="FAILED rc=$rc"; FAILED=1; fi
    echo "--- $name: $verdict ($((SECONDS - t0))s)"
    finish_step "$name" "$verdict" "$((SECONDS - t0))s"
    [ "$verdict" = ok ]
}

echo "device check $STAMP: logs in $LOGS${OUT:+, published to $OUT}"
write_summary
: >"$LOGS/preflight.env"
step preflight bash "$SELF" --preflight "$LOGS/preflight.env"
TORCH_GPUS="" NVIDIA_SMI_GPUS=0 HAVE_SANITIZER=0 HAVE_TRANSFORMERS=0 HAVE_PYTEST_XDIST=0
# shellcheck disable=SC1091
. "$LOGS/preflight.env"
# torch's answer decides; if it gave none in time, nvidia-smi's (the build then says if torch works)
if [ "${TORCH_GPUS:-0}" != 0 ] || { [ -z "$TORCH_GPUS" ] && [ "$NVIDIA_SMI_GPUS" = 1 ]; }; then
    MODE="GPU path"
else
    MODE="CPU path (no GPU visible)"
    PLAN=$CPU_PLAN
fi
echo "=== $MODE"
write_summary
TEST_ARGS=(-q -p no:cacheprovider --maxfail=25)
# the tests compile Triton kernels by the hundred: a few processes compile them side by side
[ "$HAVE_PYTEST_XDIST" = 1 ] && XDIST=(-n "${TEST_WORKERS:-8}") || XDIST=()

if [ "$PLAN" = "$GPU_PLAN" ]; then
    # no network on the device machine: build with what is installed, fetch nothing
    if step build env PAGED_OPS_CUDA=on PAGED_OPS_CUDA_ARCHS="${PAGED_OPS_CUDA_ARCHS:-90}" PAGED_OPS_CUDA_EMU=off \
        bash -c '"$0" -m pip install -q --no-build-isolation --no-deps --config-settings=cmake.define.PAGED_OPS_CPU_ISAS=portable -e . &&
                 "$0" -c "import paged_ops; print(\"backends:\", paged_ops.available_backends())"' "$PY"; then
        BUILT=1
    else
        BUILT=0
    fi
    cp build/*/.ninja_log "$LOGS/build-ninja_log.txt" 2>/dev/null || true
    run_gpu() {  # run_gpu NAME CMD...: a step that needs the build
        if [ "$BUILT" = 1 ]; then step "$@"; else skip "$1" "the build failed"; fi
    }
    BENCH_ENV=(env PAGED_BENCH_PROFILE=device-check PAGED_BENCH_RESULTS="$LOGS")
    run_gpu bench-kernels "${BENCH_ENV[@]}" PAGED_BENCH_TUNE_S="$BENCH_TUNE_S" \
        "$PY" -m pytest "${TEST_ARGS[@]}" bench/test_kernels.py --benchmark-enable
    # the kernel tests (variants, merges, batch invariance of test_cuda_gpu.py), what the emulator
    # cannot prove (test_cuda_device_checks.py: odd-offset views, padded tensor-core head sizes, a
    # cache past 2^31 elements, the kernel-bug regressions), the tuned cuda/triton choice followed by
    # the public op on CUDA tensors (test_backend_choice.py), the engine end to end on the GPU
    ENGINE=(tests/test_engine_e2e.py)
    [ "$HAVE_TRANSFORMERS" = 1 ] || ENGINE=()
    run_gpu gpu-tests env PAGED_OPS_AUTOTUNE=0 "$PY" -m pytest "${TEST_ARGS[@]}" "${XDIST[@]}" \
        tests/test_cuda_gpu.py tests/test_triton.py tests/test_cuda_device_checks.py \
        tests/test_backend_choice.py "${ENGINE[@]}"
    run_gpu bench-references "${BENCH_ENV[@]}" "$PY" -m pytest "${TEST_ARGS[@]}" bench/test_references.py --benchmark-enable
    # the op contract on CUDA tensors (test_ops.py's cuda and triton cases; its cpu ones run in
    # `make test`) and the attention variants in both CUDA prefill kernels
    run_gpu gpu-contract env PAGED_OPS_AUTOTUNE=0 "$PY" -m pytest "${TEST_ARGS[@]}" "${XDIST[@]}" \
        tests/test_ops.py tests/test_cuda_prefill_variants.py -k "[cuda- or [cuda] or [triton- or [triton] or [cuda:"
    if [ "$HAVE_SANITIZER" = 1 ]; then
        # memcheck slows kernels ~100x: the CUDA tests' smaller cases only
        run_gpu memcheck env PAGED_OPS_AUTOTUNE=0 compute-sanitizer --tool memcheck --error-exitcode 99 \
            --target-processes all "$PY" -m pytest "${TEST_ARGS[@]}" -x tests/test_cuda_gpu.py \
            -k "${MEMCHECK_K:-decode or prefill or reshape or merge}"
        # shared-memory hazards and barrier misuse in the kernels that stage through shared memory
        # (shared-KV decode, tensor-core prefill): test_cuda_device_checks.py's small cases
        for tool in racecheck synccheck; do
            run_gpu $tool env PAGED_OPS_AUTOTUNE=0 compute-sanitizer --tool $tool --error-exitcode 99 \
                --target-processes all "$PY" -m pytest "${TEST_ARGS[@]}" -x tests/test_cuda_device_checks.py -k sanitize
        done
    else
        for tool in memcheck racecheck synccheck; do skip $tool "no working compute-sanitizer"; done
    fi
    # issue #13: sliding-window decode at L = 4k/16k/64k and the batch-invariant mode's cost
    run_gpu variants-bench env PAGED_OPS_AUTOTUNE=0 PAGED_BENCH_TUNE_S=0 PAGED_BENCH_RESULTS="$LOGS" \
        "$PY" -m bench.variants window batch-invariant --backends cuda,triton --save
else
    step kernel-bench-cpu env PAGED_BENCH_PROFILE="${CPU_PROFILE:-smoke}" PAGED_BENCH_RESULTS="$LOGS" \
        "$PY" -m pytest "${TEST_ARGS[@]}" bench/test_kernels.py --benchmark-enable
fi

step headline "$PY" -m bench.headline "$LOGS" --json "$LOGS/headline.json"

echo
echo "=== device check summary ($STAMP)"
cat "$LOGS/summary.txt"
echo
cat "$LOGS/headline.log"
exit $FAILED
