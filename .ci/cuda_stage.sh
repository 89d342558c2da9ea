#!/usr/bin/env bash
# CI stage: build torchcast with its CUDA kernels (TORCHCAST_CUDA=1) in a
# second virtualenv holding a CUDA torch, check what the compiler says about
# them (.ci/cuda_facts.py: registers, no spills, no fused multiply-add the
# source did not ask for, no floating-point atomics), import the build on
# this machine (which may have no GPU: nothing CUDA runs here) and run the
# ops' tests against it (OPS_SLICE below). The CUDA tests themselves skip
# without a GPU; benchmarks/gpu_check.sh runs them on one.
#
# Skipped, not failed, where nvcc is absent or the disk has no room for a
# CUDA torch (about 7 GiB). Knobs:
#   TORCHCAST_CI_CUDA_ARCH  TORCH_CUDA_ARCH_LIST for this build (default 9.0:
#                           one architecture keeps the stage's nvcc time about
#                           half of the default sm_80 + sm_90 + PTX build,
#                           which setup.py still builds everywhere else)
#   MAX_JOBS                parallel compile jobs (default 2, the CI's cores)
#   PYTHON                  interpreter for the virtualenv (default python3)
# The virtualenv (.venv-cuda) and the build (build/cuda-stage) persist across
# runs and are reused; both are gitignored.
#
#   bash .ci/cuda_stage.sh            the whole stage
#   bash .ci/cuda_stage.sh --prepare  only the virtualenv (.ci/run starts this
#                                     in the background, early)
set -euo pipefail
PREPARE=0
if [ "${1:-}" = "--prepare" ]; then PREPARE=1; fi
cd "$(dirname "$0")/.."
ROOT=$PWD
TORCH_CUDA_PIN=2.14.1

if ! command -v nvcc >/dev/null 2>&1; then
  echo "cuda stage: SKIPPED: nvcc is not on PATH, so the CUDA extension cannot be compiled here"
  exit 0
fi

step() { echo "-- cuda stage [${SECONDS}s]: $*"; }

# torch derives CUDA_HOME from nvcc's location, which is wrong when nvcc on
# PATH is a wrapper script (e.g. /usr/local/bin/nvcc): ask nvcc where it lives.
if [ -z "${CUDA_HOME:-}" ]; then
  probe=$(mktemp -d)
  touch "$probe/probe.cu"
  top=$(cd "$probe" && nvcc --dryrun -c probe.cu 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n1)
  rm -rf "$probe"
  if [ -n "$top" ]; then CUDA_HOME=$(cd "$top" && pwd); export CUDA_HOME; fi
fi
step "nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), CUDA_HOME=${CUDA_HOME:-torch decides}"

VENV=$ROOT/.venv-cuda
if ! "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_CUDA_PIN' or torch.version.cuda is None)" 2>/dev/null; then
  rm -rf "$VENV"
  # The CUDA torch takes 5.5 GB in the venv and the build about 0.2 GB more;
  # on a machine without that room the stage cannot run: say so, don't fail.
  free_kb=$(df -Pk "$ROOT" | awk 'NR == 2 {print $4}')
  if [ "$free_kb" -lt $((7 * 1024 * 1024)) ]; then
    echo "cuda stage: SKIPPED: $((free_kb / 1024)) MiB free on $ROOT; a CUDA torch venv needs about 7 GiB"
    exit 0
  fi
  step "creating $VENV with torch==$TORCH_CUDA_PIN (CUDA build, several GB)"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# The project's requirements with the CPU torch pin swapped for the CUDA one,
# installed on every run: a reused virtualenv also gets requirements added
# since it was made (a no-op when nothing is missing).
grep -v '^torch\b' requirements.txt > "$VENV/requirements-cuda.txt"
echo "torch==$TORCH_CUDA_PIN" >> "$VENV/requirements-cuda.txt"
# --no-compile: byte-compiling the CUDA torch's files costs minutes of CPU;
# Python compiles what it imports.
if ! "$VENV/bin/python" -m pip install -q --no-cache-dir --no-compile \
    -r "$VENV/requirements-cuda.txt" > "$VENV/pip.log" 2>&1; then
  cat "$VENV/pip.log"
  exit 1
fi
"$VENV/bin/python" -c "import torch; print('   torch', torch.__version__, 'CUDA', torch.version.cuda)"
if [ "$PREPARE" = 1 ]; then
  step "prepared"
  exit 0
fi

# The CUDA torch keeps cuBLAS/cuSPARSE headers (included by ATen's CUDA
# headers) in its nvidia wheel, not in the toolkit.
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for inc in "$site"/nvidia/cu*/include; do
  [ -d "$inc" ] && export CPATH="$inc${CPATH:+:$CPATH}"
done

# Build in a copy of the tree: the CPU build in ./torchcast stays untouched.
# tar keeps mtimes, so ninja recompiles only what changed since the last run.
STAGE=$ROOT/build/cuda-stage
step "copying the tree to $STAGE"
mkdir -p "$STAGE"
for d in csrc torchcast tests benchmarks; do rm -rf "${STAGE:?}/$d"; done
git ls-files -z --cached --others --exclude-standard \
  | tar --null --ignore-failed-read -cf - -T - 2>/dev/null | tar -xpf - -C "$STAGE"

# The build keeps its PTX and cubins and prints ptxas' report (flags that
# change no instruction), so that .ci/cuda_facts.py reads the build's own
# output instead of compiling every kernel a second time.
FACTS=$STAGE/build/cuda-facts
mkdir -p "$FACTS/build"
step "building with TORCHCAST_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCHCAST_CI_CUDA_ARCH:-9.0}"
(cd "$STAGE" && TORCHCAST_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCHCAST_CI_CUDA_ARCH:-9.0}" \
   TORCHCAST_NVCC_FLAGS="--resource-usage -lineinfo --keep --keep-dir $FACTS/build" \
   MAX_JOBS="${MAX_JOBS:-2}" "$VENV/bin/python" setup.py -q build_ext --inplace) \
  > "$FACTS/build.log" 2>&1 || { tail -n 200 "$FACTS/build.log"; exit 1; }

step "what the compiler says about the kernels (.ci/cuda_facts.py)"
temp=$(ls -d "$STAGE"/build/temp.*/ | head -n1)
"$VENV/bin/python" .ci/cuda_facts.py "$temp" "$FACTS" --from-build "$FACTS/build.log" --control \
  --jobs "${MAX_JOBS:-2}"

step "importing the CUDA build on this machine"
(cd "$STAGE" && PYTHONPATH=$STAGE "$VENV/bin/python" - <<'EOF'
import torch
import torchcast
from torchcast import _ops

assert torchcast.__file__.startswith(__import__("os").getcwd()), torchcast.__file__
assert _ops.WITH_CUDA, "torchcast._C was built without its CUDA kernels"
for name in ("torchcast::cast_with_stats", "torchcast::cast_with_stats.out",
             "torchcast::adam_step_", "torchcast::kahan_sum", "torchcast::kahan_mean",
             "torchcast::tensor_health"):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"), name
print("   torchcast CUDA build imported:", torchcast._C.__file__,
      "| GPU present:", torch.cuda.is_available())
EOF
)

# The ops' tests under this torch (the CUDA build of $TORCH_CUDA_PIN: its
# dispatcher, autocast and compile): every op, its registration, opcheck,
# gradcheck and errors. The rest of the suite (the tracker, the reports)
# runs against the CPU build in .ci/run, and the emulated grid, which
# compiles the same csrc/cuda sources, is built and run once, there.
OPS_SLICE="tests/test_cast.py tests/test_adam.py tests/test_reduce.py tests/test_health.py
  tests/test_block_cast.py tests/test_api_errors.py tests/test_float8.py tests/test_scaling.py
  tests/test_stats.py tests/test_adam_moments8.py tests/test_packaging.py"
step "the ops' tests against the CUDA build"
# shellcheck disable=SC2086
(cd "$STAGE" && PYTHONPATH=$STAGE "$VENV/bin/python" -m pytest -q -p no:cacheprovider $OPS_SLICE)
step "done"
