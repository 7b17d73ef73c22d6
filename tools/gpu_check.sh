#!/usr/bin/env bash
# The GPU check: the one command for a machine with a CUDA GPU.
#
#   tools/gpu_check.sh [WHEELS_DIR]
#
# 1. install: every package (packages/torch too) into $SITE, without network and without
#    dependencies, over a Python that already has numba, numba-cuda, cuda-python
#    (cuda-bindings), an NCCL wheel and, for the torch steps, torch with CUDA;
# 2. the versions and the GPU; without a usable GPU the check stops here (exit 1);
# 3. tests on the device (NUMBA_ENABLE_CUDASIM=0): the gpu-marked tests (-m gpu tests),
#    then tests/gpu tests/nccl (the CUDA kernels against the CPU kernels, NCCL);
# 4. benchmarks: bench/gpu/all_reduce.py (ferrodist, its floor and Gloo), bench/gpu/kernels.py
#    (reduce_into against torch add_), bench/gpu/ddp.py (ferrodist's DDP, torch's DDP over
#    "ferrodist" and over Gloo); the last two need torch with CUDA and are skipped without it;
# 5. one summary table (tools/gpu_summary.py) from what the steps wrote into $RESULTS: each
#    test step's counts, the benchmarks' rows, how to rerun each step.
#
# Each step's command is printed (after "+") before it runs. A step that fails, crashes
# (a segfault included) or runs past $STEP_TIMEOUT is recorded and the next step runs; the
# exit status is 0 only when every step that ran passed.
#
# WHEELS_DIR (default .whl) may hold wheels to install first, without dependencies: a numpy
# that numba-cuda imports with (numba-cuda 0.30.4 fails under numpy 2.5: np.row_stack is
# gone; numba 0.68 needs numpy < 2.5) and hatchling + trove-classifiers, pathspec, pluggy,
# packaging (the packages' build backend). Fetch them on a machine with network:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d .whl numpy==2.4.6 hatchling trove-classifiers \
#       pathspec pluggy packaging
#
# Environment (defaults in brackets):
#   PYTHON [python3]  SITE [/tmp/ferrodist-site]  BUILD [/tmp/ferrodist-build]
#   RESULTS [/tmp/ferrodist-gpu-check]: the steps' results and the environment to rerun one
#   STEP_TIMEOUT [1800]: seconds one step may run
#   INSTALL [1]: 0 uses the ferrodist packages $PYTHON already imports (a dev .venv) instead
# Nothing outside $SITE, $BUILD and $RESULTS is written.
set -euo pipefail

WHEELS=${1:-.whl}
[[ -d $WHEELS ]] && WHEELS=$(cd "$WHEELS" && pwd)
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SITE=${SITE:-/tmp/ferrodist-site}
BUILD=${BUILD:-/tmp/ferrodist-build}
RESULTS=${RESULTS:-/tmp/ferrodist-gpu-check}
STEP_TIMEOUT=${STEP_TIMEOUT:-1800}
PY=${PYTHON:-python3}
PACKAGES=(packages/core packages/transport packages/collectives packages/testing packages/gpu packages/nccl
          packages/nn packages/ddp packages/pipeline packages/launch packages/torch)

PLAIN='^[A-Za-z0-9_./=:,@%+-]+$'
quote() {  # the words as a shell reads them back: plain words as they are, the rest quoted
    local word words=()
    for word in "$@"; do
        if [[ $word =~ $PLAIN ]]; then words+=("$word"); else words+=("$(printf '%q' "$word")"); fi
    done
    echo "${words[*]}"
}
show() { echo "+ $(quote "$@")"; "$@"; }

mkdir -p "$RESULTS"
rm -f "$RESULTS"/steps.tsv "$RESULTS"/*.jsonl "$RESULTS"/*.json "$RESULTS"/env.sh

if [[ ${INSTALL:-1} != 0 ]]; then
    echo "== install into $SITE"
    mkdir -p "$SITE" "$BUILD"
    shopt -s nullglob
    backend=("$WHEELS"/hatchling-*.whl "$WHEELS"/trove_classifiers-*.whl "$WHEELS"/pathspec-*.whl
             "$WHEELS"/pluggy-*.whl "$WHEELS"/packaging-*.whl)
    if ((${#backend[@]})); then
        show "$PY" -m pip install -q --no-deps --no-index --upgrade --target "$BUILD" "${backend[@]}"
    fi
    extra=("$WHEELS"/numpy-*.whl)
    shopt -u nullglob
    show env PYTHONPATH="$BUILD" "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --upgrade \
        --target "$SITE" "${extra[@]}" "${PACKAGES[@]}"
    export PYTHONPATH="$SITE" PATH="$SITE/bin:$PATH"
fi
export NUMBA_ENABLE_CUDASIM=0
echo "export PYTHONPATH=$(quote "${PYTHONPATH:-}") PATH=$(quote "$PATH") NUMBA_ENABLE_CUDASIM=0" > "$RESULTS/env.sh"
echo "== every step runs from $ROOT with: $(cat "$RESULTS/env.sh")"

echo "== what this machine has"
RESULTS="$RESULTS" "$PY" - <<'EOF'
import importlib, json, os, platform
facts = {"python": platform.python_version()}
for name in ("numpy", "numba", "numba_cuda", "cuda.bindings", "torch", "mpi4py"):
    try:
        facts[name] = getattr(importlib.import_module(name), "__version__", "?")
    except Exception as exc:  # a missing or broken module is worth one line, not a stop
        facts[name] = f"unavailable ({type(exc).__name__}: {exc})"
try:
    from ferrodist.nccl import nccl_version
    facts["nccl"] = ".".join(map(str, nccl_version()))
except Exception as exc:
    facts["nccl"] = f"unavailable ({exc})"
for name, value in facts.items():
    print(name, value)
try:
    from numba import cuda
    device = cuda.get_current_device()
    name = device.name.decode() if isinstance(device.name, bytes) else device.name
    major, minor = device.compute_capability
    facts["gpu"] = f"{name} (compute capability {major}.{minor})"
    print("gpu", facts["gpu"])
except Exception as exc:
    why = " ".join(f"{type(exc).__name__}: {exc}".split()).rstrip(": ")
    raise SystemExit(f"no usable CUDA GPU ({why}): this check needs one and stops here; on a CPU machine run make test")
with open(os.path.join(os.environ["RESULTS"], "machine.json"), "w") as out:
    json.dump(facts, out)
EOF

status=0
step() {  # step ID COMMAND...: print the command, run it (at most STEP_TIMEOUT s), record its exit status
    local id=$1 line rc=0
    shift
    line=$(quote "$@")
    echo "== $id"
    echo "+ $line"
    timeout -k 30 "$STEP_TIMEOUT" "$@" || rc=$?
    printf '%s\t%s\t%s\n' "$id" "$rc" "$line" >> "$RESULTS/steps.tsv"
    if ((rc != 0)); then
        status=1
        echo "== $id: exit status $rc; going on with the next step"
    fi
}
skip() {  # skip ID REASON
    printf '%s\tskip: %s\t\n' "$1" "$2" >> "$RESULTS/steps.tsv"
    echo "== $1: skipped: $2"
}
pytest_step() {  # pytest_step ID PYTEST_ARGS...: pytest, its events recorded by tools/gpu_summary.py
    local id=$1
    shift
    step "$id" env FERRODIST_GPU_REPORT="$RESULTS/$id.jsonl" PYTHONPATH="$ROOT/tools${PYTHONPATH:+:$PYTHONPATH}" \
        "$PY" -m pytest -q -p gpu_summary "$@"
}

pytest_step tests-gpu-marked -m gpu tests
pytest_step tests-device tests/gpu tests/nccl

step bench-all-reduce "$PY" -m ferrodist.launch run -n 2 bench/gpu/all_reduce.py --sizes 4K,64K,1M,16M,64M \
    --reps 10 --rounds 3 --json "$RESULTS/bench-all-reduce.json"
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    step bench-kernels "$PY" bench/gpu/kernels.py --json "$RESULTS/bench-kernels.json"
    step bench-ddp "$PY" -m ferrodist.launch run -n 2 bench/gpu/ddp.py --json "$RESULTS/bench-ddp.json"
else
    skip bench-kernels "torch with CUDA is not installed"
    skip bench-ddp "torch with CUDA is not installed"
fi

"$PY" "$ROOT/tools/gpu_summary.py" "$RESULTS" || status=1
exit $status
