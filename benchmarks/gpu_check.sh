#!/usr/bin/env bash
# The GPU check, one command, on a machine with an NVIDIA GPU and no internet
# (made for an H200 with torch 2.11+cu130 and Python 3.12 preinstalled, nvcc
# 13.0, ninja): builds torchcast for sm_90 in place, runs the CUDA tests
# (tests/test_cuda.py: CPU-vs-CUDA bit-identity and the rest), runs the CUDA
# benchmark and prints its markdown table. Finishes in under 8 minutes: every
# step runs under a timeout cut from one 470-second budget.
#
#   bash benchmarks/gpu_check.sh
#
# Installs nothing from the network. Python packages missing there can be
# carried as wheels in .whl/ (see the device notes); they go to /tmp/site.
# Where $OUT is set, the logs and the table are copied there.
# Knobs: TORCH_CUDA_ARCH_LIST (default 9.0), PYTHON (default python3),
#        MAX_JOBS (default: the cores).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the in-place build, for the benchmark too
PY=${PYTHON:-python3}
BUDGET=470
LOGS=$(mktemp -d)
status=0

left() { echo $((BUDGET - SECONDS)); }
step() { echo; echo "== gpu_check [${SECONDS}s]: $*"; }
collect() {
  if [ -n "${OUT:-}" ]; then
    cp "$LOGS"/* "$OUT"/ 2>/dev/null
    cp benchmarks/results/cuda.md "$OUT"/ 2>/dev/null
  fi
}

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
nvcc --version | tail -n 2 || { echo "nvcc not found: cannot build the CUDA kernels"; exit 1; }
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" - <<'EOF' || { echo "a GPU and torch with CUDA are needed"; exit 1; }
import importlib.util, sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda)
assert torch.cuda.is_available(), "no CUDA device visible"
print("device:", torch.cuda.get_device_name(0))
missing = [m for m in ("pytest", "hypothesis", "numpy") if importlib.util.find_spec(m) is None]
assert not missing, f"missing Python packages (carry them as wheels in .whl/): {missing}"
EOF

# torch derives CUDA_HOME from nvcc's path, wrong when nvcc is a wrapper script.
if [ -z "${CUDA_HOME:-}" ]; then
  probe=$(mktemp -d); touch "$probe/probe.cu"
  top=$(cd "$probe" && nvcc --dryrun -c probe.cu 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n1)
  rm -rf "$probe"
  [ -n "$top" ] && CUDA_HOME=$(cd "$top" && pwd) && export CUDA_HOME
fi
# cuBLAS/cuSPARSE headers of pip-installed CUDA torch live in its nvidia wheels.
site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for inc in "$site"/nvidia/cu*/include; do
  [ -d "$inc" ] && export CPATH="$inc${CPATH:+:$CPATH}"
done

step "build: TORCHCAST_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} (CUDA_HOME=${CUDA_HOME:-torch decides})"
if ! TORCHCAST_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
     MAX_JOBS="${MAX_JOBS:-$(nproc)}" timeout "$(left)" \
     "$PY" setup.py build_ext --inplace > "$LOGS/build.log" 2>&1; then
  tail -n 60 "$LOGS/build.log"
  echo "BUILD FAILED"
  collect
  exit 1
fi
grep -E "^\[[0-9]+/[0-9]+\]" "$LOGS/build.log" | sed 's/ -.*//' || true

step "CUDA tests (tests/test_cuda.py)"
# Leave the benchmark at least 100 seconds.
test_budget=$(( $(left) - 100 )); [ "$test_budget" -gt 30 ] || test_budget=30
timeout "$test_budget" "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py \
  --junitxml="$LOGS/test_cuda.xml" 2>&1 | tee "$LOGS/test_cuda.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "CUDA TESTS FAILED (exit $rc; 124 = ran out of time)"; status=1; }

step "benchmark (benchmarks/cuda_bench.py)"
timeout "$(left)" "$PY" benchmarks/cuda_bench.py 2>&1 | tee "$LOGS/bench.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "BENCHMARK FAILED (exit $rc; 124 = ran out of time)"; status=1; }

collect
step "done, exit $status"
exit $status
