#!/usr/bin/env bash
# The GPU checks in one command: build the CUDA backend offline, run the whole test suite on
# CUDA, run compute-sanitizer (memcheck and racecheck) over the CUDA tests, run the GPU
# benchmarks, and print one summary table. The benchmarks' JSON and logs land in OUT;
# `python benchmarks/add_result.py OUT/bench_step_cuda.json OUT/bench_train_cuda.json ...
# --machine H100` records them in benchmarks/results/ (with the date, device, torch version,
# commit and command as their metadata) and regenerates benchmarks/RESULTS.md.
#
# Usage: bash benchmarks/gpu_check.sh            (from the repository root; needs torch + nvcc)
#        Under a time limit, and where only a few files can be kept: BUDGET a little under the
#        limit, so that the script stops starting steps in time to pack what it has (PACK=1);
#        the tests that need a GPU only (marker `cuda`, pyproject.toml; the CPU tests run in CI);
#        STEPS and SAN_K narrowed to what is to be checked, e.g. for a limit of 570 s:
#          OUT=$OUT PACK=1 BUDGET=520 TESTS_M=cuda \
#            SAN_K="test_layouts or test_disjoint_check or test_deep_nested_inputs" \
#            STEPS="build tests train_cms phase1 train_legacy memcheck" bash benchmarks/gpu_check.sh
#        Measured on an H100 (one arch): build ~30 s, memcheck and racecheck ~5 and ~20 s a test,
#        a bench_train run 20-60 s; the test suite runs in 8 processes where pytest-xdist is
#        installed. memcheck, last, gets what is left; summary.txt gives each step's seconds.
# Env:   TITANMAC_CUDA_ARCHS  defaults to the compute capability of GPU 0 (fast build)
#        OUT                  folder for logs and JSON (default benchmarks/out)
#        STEPS                which checks to run, always in the script's order (default:
#                             all: "build tests large bench bench64 host train train_cms
#                             phase1 train_legacy profile dist racecheck memcheck")
#        BUDGET               seconds the whole script may take: a step is not started once
#                             they are spent ("no time"), and each runs under a timeout of what
#                             is left ("timeout"), so PACK still happens (default: no limit)
#        TESTS_M              pytest -m marker selection of the tests step (default: every
#                             test; "cuda": the tests that need a GPU, the CUDA cases of the
#                             parametrized ones and the CUDA-only ones, the CPU ones being CI's;
#                             the markers are registered in pyproject.toml)
#        TESTS_K              pytest -k selection within it (default: none)
#        PACK=1               at the end, pack every file in OUT but summary.txt into
#                             OUT/gpu_check.tar.gz (one file to keep instead of many)
#        SAN_M                pytest -m selection of both sanitizers (default: "cuda and not
#                             distributed")
#        SAN_K, RACE_K        pytest -k selections within it of memcheck and racecheck (defaults
#                             below)
#        TEST_WORKERS         pytest-xdist processes of the tests step (default 8 where xdist is
#                             installed; 0: one process)
#        SAN_TIMEOUT          seconds each sanitizer may run (default: no limit); one stopped
#                             there reports "timeout" with the tests it got through in its log
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
declare -A RESULT TOOK
ALL_STEPS="build tests large bench bench64 host train train_cms phase1 train_legacy profile dist \
racecheck memcheck"
STEPS=${STEPS:-$ALL_STEPS}

step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, remember pass/fail and seconds
    local name=$1; shift
    case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
    local limit=() start=$SECONDS
    if [ -n "${BUDGET:-}" ]; then
        local left=$((BUDGET - SECONDS))
        if [ "$left" -lt 10 ]; then
            RESULT[$name]="no time"
            echo "=== $name: not started, BUDGET=$BUDGET s spent"
            return 0
        fi
        limit=(timeout -k 10 "$left")
    fi
    echo "=== $name: $*"
    "${limit[@]}" "$@" 2>&1 | tee "$OUT/$name.log"
    case ${PIPESTATUS[0]} in
        0) RESULT[$name]=pass ;;
        124|137) RESULT[$name]=timeout ;;  # 137: killed 10 s after the TERM
        *) RESULT[$name]=FAIL ;;
    esac
    TOOK[$name]=$((SECONDS - start))
}

if [ -z "${TITANMAC_CUDA_ARCHS:-}" ]; then
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d .)
    export TITANMAC_CUDA_ARCHS=${cap:-90}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

step build env TITANMAC_WITH_CUDA=1 python3 -m pip install --no-build-isolation --no-deps -q .
# torch's optimizer test inputs (tests/adamw/test_torch_optim_db.py) need expecttest, which an
# offline machine may lack: wheels carried in .whl/ (pip download expecttest -d .whl) install
# here; without them those tests are reported as skipped.
if ! python3 -c "import expecttest" 2>/dev/null && ls .whl/expecttest-*.whl >/dev/null 2>&1; then
    python3 -m pip install --no-index --no-deps -q .whl/expecttest-*.whl
fi
# With pytest-xdist (where it is installed) the suite runs in TEST_WORKERS processes, each
# with 2 CPU threads (the suite passes so on the CPU too; each process holds its own CUDA
# context); TEST_WORKERS=0 runs it in one.
if [ "${TEST_WORKERS:-8}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
    PYTEST=(env OMP_NUM_THREADS=2 python3 -P -m pytest -n "${TEST_WORKERS:-8}")
else
    PYTEST=(python3 -P -m pytest)
fi
TESTS_SELECT=()
[ -n "${TESTS_M:-}" ] && TESTS_SELECT+=(-m "$TESTS_M")
[ -n "${TESTS_K:-}" ] && TESTS_SELECT+=(-k "$TESTS_K")
step tests "${PYTEST[@]}" -q -rfEs "${TESTS_SELECT[@]}" tests
# Tensors past 2^31 elements on the GPU (~18 GB of its memory; the suite skips them otherwise)
step large env TITANMAC_LARGE_TESTS=1 python3 -P -m pytest -q -rfEs -m "large and cuda" tests
step bench python3 benchmarks/bench_step.py --device cuda --out "$OUT/bench_step_cuda.json"
step bench64 python3 benchmarks/bench_step.py --device cuda --dtype float64 --sizes titanmac,gpt2 \
    --out "$OUT/bench_step_cuda_float64.json"
step host python3 benchmarks/bench_host.py --device cuda
step train python3 benchmarks/bench_train.py --device cuda --steps 100 \
    --out "$OUT/bench_train_cuda.json"
step train_cms python3 benchmarks/bench_train.py --device cuda --mode cms --steps 100 \
    --out "$OUT/bench_train_cms_cuda.json"
step phase1 python3 benchmarks/bench_phase1.py --device cuda
step train_legacy python3 benchmarks/bench_train.py --device cuda --mode cms --net legacy \
    --steps 100 --out "$OUT/bench_train_legacy_cuda.json"
step profile python3 benchmarks/profile_step.py --device cuda --sizes titanmac,d1024l8 \
    --out "$OUT/profile_step_cuda.json"
step dist python3 benchmarks/bench_distributed.py --device cuda --world 1 --layers 50 \
    --width 2048

# The sanitizers last: a BUDGET that runs out cuts their coverage, not the benchmarks.
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# The sanitizers run the tests that need a GPU only (the CPU ones do not touch it), less the
# distributed one (the FSDP2 test spawns an NCCL process group: not a kernel of ours, and slow
# under memcheck) and the long parity runs (hundreds of steps of the same kernels; 10-100x slower
# under a sanitizer).
SAN_M=${SAN_M:-"cuda and not distributed"}
SAN_K=${SAN_K:-"not (300_steps or 250_steps or 100_steps or 30_steps or titanmac_like)"}
# racecheck takes ~20 s a test on an H100 (the whole SAN_K set would take hours): one test family
# per kernel family, CMS (both networks) first.
RACE_K=${RACE_K:-"test_cpu_and_cuda_agree or test_group_norms_match_reference \
or test_clip_grad_norm_matches_torch or test_parity_fp32_groups \
or test_more_tensors_than_one_launch_holds or (test_dno_control and test_steps_match_reference)"}
SAN_LIMIT=()
[ -n "${SAN_TIMEOUT:-}" ] && SAN_LIMIT=(timeout "$SAN_TIMEOUT")
step racecheck "${SAN_LIMIT[@]}" "$SAN" --tool racecheck --error-exitcode 1 \
    python3 -P -m pytest -q -x -m "$SAN_M" -k "$RACE_K" tests/cms/test_cms_op.py tests
# torch's caching allocator hides out-of-bounds accesses inside its pools from memcheck, so
# PYTORCH_NO_CUDA_MEMORY_CACHING=1 gives every tensor its own allocation here. Without the cache
# no tensor can be allocated inside a graph capture: memcheck skips the graph tests.
step memcheck env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${SAN_LIMIT[@]}" "$SAN" --tool memcheck \
    --error-exitcode 1 python3 -P -m pytest -q -x -m "$SAN_M" -k "($SAN_K) and not graph" tests

status=0
{
    echo
    echo "=== summary ($(date -u +%Y-%m-%d), $(head -n1 "$OUT/gpu.txt"))"
    printf '%-12s %-8s %s\n' check result seconds
    for name in $STEPS; do
        printf '%-12s %-8s %s\n' "$name" "${RESULT[$name]:-not run}" "${TOOK[$name]:--}"
    done
    [ -f "$OUT/tests.log" ] && grep -E "passed|failed|skipped" "$OUT/tests.log" | tail -n1
} | tee "$OUT/summary.txt"
for name in $STEPS; do
    [ "${RESULT[$name]:-}" = pass ] || status=1
done  # a timeout counts as not passed
if [ "${PACK:-0}" = 1 ]; then
    (cd "$OUT" && find . -type f ! -name summary.txt ! -name gpu_check.tar.gz -print0 \
        | tar --null -czf gpu_check.tar.gz --remove-files -T -)
fi
exit $status
