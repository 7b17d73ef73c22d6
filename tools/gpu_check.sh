#!/usr/bin/env bash
# The GPU check: install ferrodist without network on a CUDA machine that already has numba,
# numba-cuda, cuda-python (cuda-bindings) and an NCCL wheel, then run the gpu-marked tests
# and the kernel tests on the real device, then the all_reduce and kernel benchmarks
# (bench/gpu/all_reduce.py: ferrodist, its floor and Gloo in one table; bench/gpu/kernels.py).
#
#   tools/gpu_check.sh [WHEELS_DIR]        (run from the repository root)
#
# WHEELS_DIR (default .whl) may hold wheels to install first, without dependencies: a numpy
# that numba-cuda imports with (numba-cuda 0.30.4 fails under numpy 2.5: np.row_stack is
# gone; numba 0.68 needs numpy < 2.5) and hatchling + trove-classifiers (the packages'
# build backend). Fetch them on a machine with network:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d .whl numpy==2.4.6 hatchling trove-classifiers
# Everything is installed into $SITE (default /tmp/ferrodist-site); nothing else is touched.
set -euo pipefail

WHEELS=${1:-.whl}
SITE=${SITE:-/tmp/ferrodist-site}
BUILD=${BUILD:-/tmp/ferrodist-build}
PY=${PYTHON:-python3}
PACKAGES="packages/core packages/transport packages/collectives packages/testing packages/gpu packages/nccl
          packages/nn packages/ddp packages/pipeline packages/launch"

echo "== install into $SITE"
mkdir -p "$SITE" "$BUILD"
shopt -s nullglob
backend=("$WHEELS"/hatchling-*.whl "$WHEELS"/trove_classifiers-*.whl "$WHEELS"/pathspec-*.whl "$WHEELS"/pluggy-*.whl
         "$WHEELS"/packaging-*.whl)
if ((${#backend[@]})); then
    "$PY" -m pip install -q --no-deps --no-index --target "$BUILD" "${backend[@]}"
fi
extra=("$WHEELS"/numpy-*.whl)
# shellcheck disable=SC2086
PYTHONPATH="$BUILD" "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" \
    "${extra[@]}" $PACKAGES

export PYTHONPATH="$SITE" PATH="$SITE/bin:$PATH" NUMBA_ENABLE_CUDASIM=0

echo "== what this machine has"
"$PY" - <<'EOF'
import importlib, platform
print("python", platform.python_version())
for name in ("numpy", "numba", "numba_cuda", "cuda.bindings", "torch", "mpi4py"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:  # a missing or broken module is worth one line, not a stop
        print(name, "unavailable:", type(exc).__name__, exc)
try:
    from ferrodist.nccl import nccl_version
    print("nccl", nccl_version())
except Exception as exc:
    print("nccl unavailable:", exc)
try:
    from numba import cuda
    device = cuda.get_current_device()
    print("gpu", device.name.decode() if isinstance(device.name, bytes) else device.name,
          "compute capability", device.compute_capability)
except Exception as exc:
    raise SystemExit(f"no usable CUDA GPU ({exc}): this check needs one; on a CPU machine run make test")
EOF

status=0
echo "== tests on the device (gpu-marked, and the CUDA kernels against the CPU kernels)"
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests || status=1
"$PY" -m pytest -q -p no:cacheprovider tests/gpu tests/nccl || status=1

echo "== all_reduce of CUDA tensors: ferrodist staged, its floor, Gloo (2 processes, one table)"
ferrodist run -n 2 bench/gpu/all_reduce.py --sizes 4K,64K,1M,16M,64M --reps 10 --rounds 3 || status=1
if "$PY" -c "import torch" 2>/dev/null; then
    echo "== device kernels against torch add_"
    "$PY" bench/gpu/kernels.py || status=1
fi
exit $status
