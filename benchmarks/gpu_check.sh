#!/usr/bin/env bash
# The GPU checks in one command: build the CUDA backend offline, run the whole test suite on
# CUDA, run compute-sanitizer (memcheck and racecheck) over the CUDA tests, run the GPU
# benchmarks, and print one summary table. The benchmarks' JSON and logs land in OUT;
# `python benchmarks/add_result.py OUT/bench_step_cuda.json OUT/bench_train_cuda.json ...
# --machine H100` records them in benchmarks/results/ (with the date, device, torch version,
# commit and command as their metadata) and regenerates benchmarks/RESULTS.md.
#
# Usage: bash benchmarks/gpu_check.sh            (from the repository root; needs torch + nvcc)
#        By default the one-call plan for a machine held for a few minutes (STEPS below), in the
#        order of what its results are worth: build; the tests; bench_step (device and host time
#        apart); bench_train in both modes and with both CMS networks (each also as a CUDA
#        graph); memcheck over what no sanitizer has run: the CUDA-graph captures (the legacy
#        network's CMS steps, a capture again after a host number changed, Phase 1 between two
#        graphs), then the layout, DeepNestedOptimizer-input and CUDA Phase 1 tests; last
#        profile_step, whose figures earlier runs have. Under a time limit, and where only a few
#        files can be kept: BUDGET a little under the limit, so that the script stops starting
#        steps in time to pack what it has (PACK=1); the tests that need a GPU only (marker
#        `cuda`, pyproject.toml; the CPU tests run in CI). For a limit of 570 s:
#          OUT=$OUT PACK=1 BUDGET=520 TESTS_M=cuda bash benchmarks/gpu_check.sh
#        Measured on an H100 (one arch): build ~30 s, memcheck and racecheck ~5 and ~20 s a test
#        (a test that trains the model for a few dozen steps: longer), a bench_train run 20-60 s;
#        the test suite runs in 8 processes where pytest-xdist is installed. The sanitizers
#        get what the benchmarks leave, and log a line per test (-v), so a cut run still says
#        which tests they got through; summary.txt gives each step's seconds. STEPS=all runs
#        every step (without BUDGET; MEMCHECK_TESTS=tests: the whole suite under memcheck).
# Env:   TITANMAC_CUDA_ARCHS  defaults to the compute capability of GPU 0 (fast build)
#        WHEEL                a binary wheel (.whl) to install with pip --no-deps instead of
#                             building: the one wheel CI builds, checked on this machine's
#                             Python and torch (the arch test expects setup.py's default archs)
#        OUT                  folder for logs and JSON (default benchmarks/out)
#        STEPS                which checks to run, always in the script's order (default: "build
#                             tests bench train train_cms train_legacy memcheck_graph memcheck
#                             profile"; "all": those and "large bench64 host phase1 dist
#                             racecheck" after them)
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
#        SAN_M                pytest -m selection of the sanitizers (default: "cuda and not
#                             distributed")
#        SAN_K, RACE_K        pytest -k selections within it of memcheck and racecheck (defaults
#                             below)
#        MEMCHECK_TESTS       the tests memcheck runs, in this order (default below: those no
#                             sanitizer has run; "tests": the whole suite)
#        GRAPH_TESTS          the CUDA-graph tests memcheck_graph runs, in this order (below)
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
PLAN_STEPS="build tests bench train train_cms train_legacy memcheck_graph memcheck profile"
ALL_STEPS="$PLAN_STEPS large bench64 host phase1 dist racecheck"
STEPS=${STEPS:-$PLAN_STEPS}
[ "$STEPS" = all ] && STEPS=$ALL_STEPS

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

if [ -n "${WHEEL:-}" ]; then
    # the wheel holds the default archs: the arch test checks them, not this GPU's alone
    TITANMAC_CUDA_ARCHS=$(sed -n 's/^DEFAULT_ARCHS = "\(.*\)"$/\1/p' setup.py)
    export TITANMAC_CUDA_ARCHS
fi
if [ -z "${TITANMAC_CUDA_ARCHS:-}" ]; then
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d .)
    export TITANMAC_CUDA_ARCHS=${cap:-90}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

if [ -n "${WHEEL:-}" ]; then  # a binary wheel built elsewhere, installed as it is: no build
    step build python3 -m pip install --no-index --no-deps --force-reinstall -q "$WHEEL"
else
    step build env TITANMAC_WITH_CUDA=1 python3 -m pip install --no-build-isolation --no-deps -q .
fi
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
step bench python3 benchmarks/bench_step.py --device cuda --out "$OUT/bench_step_cuda.json"
step train python3 benchmarks/bench_train.py --device cuda --steps 100 \
    --out "$OUT/bench_train_cuda.json"
step train_cms python3 benchmarks/bench_train.py --device cuda --mode cms --steps 100 \
    --out "$OUT/bench_train_cms_cuda.json"
step train_legacy python3 benchmarks/bench_train.py --device cuda --mode cms --net legacy \
    --steps 100 --out "$OUT/bench_train_legacy_cuda.json"

# The sanitizers after the benchmarks: a BUDGET that runs out cuts their coverage, not the
# benchmarks.
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# The sanitizers run the tests that need a GPU only (the CPU ones do not touch it), less the
# distributed one (the FSDP2 test spawns an NCCL process group: not a kernel of ours, and slow
# under memcheck) and the long parity runs (hundreds of steps of the same kernels; 10-100x slower
# under a sanitizer).
SAN_M=${SAN_M:-"cuda and not distributed"}
SAN_K=${SAN_K:-"not (300_steps or 250_steps or 100_steps or 30_steps or titanmac_like)"}
SAN_LIMIT=()
[ -n "${SAN_TIMEOUT:-}" ] && SAN_LIMIT=(timeout "$SAN_TIMEOUT")
# CUDA-graph captures under memcheck, with torch's caching allocator (a capture allocates from
# its pools: without the cache it cannot run), so only accesses outside torch's pools are caught:
# the legacy network's CMS steps replayed, the graphs captured again after a host number changed
# (and after the weights and the parameters moved), Phase 1 between two graphs.
DNC=tests/deep_nested/test_deep_nested_cuda.py
HOST=$DNC::test_graph_mode_recaptures_when_a_host_number_changes
read -r -a GRAPH_TESTS <<< "${GRAPH_TESTS:-$HOST[cms_legacy] \
$DNC::test_graph_mode_with_the_legacy_network_matches_eager \
$DNC::test_step_makes_no_host_sync[graph-cms_legacy] \
$DNC::test_graph_mode_matches_eager_with_the_fixes_and_a_skipped_phase1_step \
$HOST[adamw] $HOST[cms] $DNC::test_graph_mode_recaptures_after_weights_and_parameters_move}"
step memcheck_graph "${SAN_LIMIT[@]}" "$SAN" --tool memcheck --error-exitcode 1 \
    python3 -P -m pytest -v -x -m "$SAN_M" "${GRAPH_TESTS[@]}"
# torch's caching allocator hides out-of-bounds accesses inside its pools from memcheck, so
# PYTORCH_NO_CUDA_MEMORY_CACHING=1 gives every tensor its own allocation here. Without the cache
# no tensor can be allocated inside a graph capture: memcheck skips the graph tests. By default
# the tests no sanitizer has run: strided and channels-last layouts, the DeepNestedOptimizer's
# inputs (frozen, unfrozen and ungrouped parameters), CUDA's Phase 1 (torch ops) in CMS mode,
# then the Phase 1 gradient alone.
read -r -a MEMCHECK_TESTS <<< "${MEMCHECK_TESTS:-tests/capi/test_layouts.py \
tests/deep_nested/test_deep_nested_layouts.py tests/deep_nested/test_deep_nested_inputs.py \
tests/cms/test_deep_nested_cms.py::test_phase1_trains_the_mlp_like_the_reference \
tests/cms/test_deep_nested_cms.py::test_a_skipped_phase1_step tests/cms/test_cms_surrogate.py}"
step memcheck env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${SAN_LIMIT[@]}" "$SAN" --tool memcheck \
    --error-exitcode 1 python3 -P -m pytest -v -x -m "$SAN_M" -k "($SAN_K) and not graph" \
    "${MEMCHECK_TESTS[@]}"
# The profile after the sanitizers: earlier runs have its figures, none has the sanitizers'.
step profile python3 benchmarks/profile_step.py --device cuda --sizes titanmac,d1024l8 \
    --out "$OUT/profile_step_cuda.json"

# The rest of STEPS=all.
# Tensors past 2^31 elements on the GPU (~18 GB of its memory; the suite skips them otherwise)
step large env TITANMAC_LARGE_TESTS=1 python3 -P -m pytest -q -rfEs -m "large and cuda" tests
step bench64 python3 benchmarks/bench_step.py --device cuda --dtype float64 --sizes titanmac,gpt2 \
    --out "$OUT/bench_step_cuda_float64.json"
step host python3 benchmarks/bench_host.py --device cuda
step phase1 python3 benchmarks/bench_phase1.py --device cuda
step dist python3 benchmarks/bench_distributed.py --device cuda --world 1 --layers 50 \
    --width 2048
# racecheck takes ~20 s a test on an H100 (the whole SAN_K set would take hours): one test family
# per kernel family, CMS (both networks) first.
RACE_K=${RACE_K:-"test_cpu_and_cuda_agree or test_group_norms_match_reference \
or test_clip_grad_norm_matches_torch or test_parity_fp32_groups \
or test_more_tensors_than_one_launch_holds or (test_dno_control and test_steps_match_reference)"}
step racecheck "${SAN_LIMIT[@]}" "$SAN" --tool racecheck --error-exitcode 1 \
    python3 -P -m pytest -q -x -m "$SAN_M" -k "$RACE_K" tests/cms/test_cms_op.py tests

status=0
{
    echo
    echo "=== summary ($(date -u +%Y-%m-%d), $(head -n1 "$OUT/gpu.txt"))"
    printf '%-15s %-8s %s\n' check result seconds
    for name in $STEPS; do
        printf '%-15s %-8s %s\n' "$name" "${RESULT[$name]:-not run}" "${TOOK[$name]:--}"
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
