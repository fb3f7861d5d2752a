#!/usr/bin/env bash
# The checks that need a GPU machine (issue 15), as one prepared run for the `device` tool.
#
# Here, once (the GPU machine cannot fetch anything; its python3 is 3.12 and holds torch):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl mpich mpi4py
# Then: device run, carry [".whl"], command "bash tools/device_checks.sh", timeout_s 600.
#
# Sets up a venv with the carried mpich/mpi4py wheels that also sees the machine's own torch
# (a .pth file), puts the five packages' sources on its path (no build, no network), and runs,
# each under its own time limit, every log also in $OUT:
#   1. the CUDA tests: smp-comm's cuda_ipc paths, smp-pipeline's offloading on CUDA;
#   2. bench_offload.py on CUDA, 2 ranks sharing the GPU: measured peak GPU memory and step
#      time with and without offloading;
#   3. bench_pipeline.py at t = 1 ms (a core per rank there, unlike the 2-core CI box);
#   4. bench_pipeline.py at t = 20 ms, if DEVICE_CHECKS_LONG=1 (about 3 more minutes).
# A step that fails or runs out of time does not stop the next one.
set -u
OUT=${OUT:-/tmp/device_checks}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1

BASE_SITE=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))') || {
    echo "python3 has no torch here"; exit 1; }
VENV=${DEVICE_CHECKS_VENV:-/tmp/smp-venv}
rm -rf "$VENV"
python3 -m venv "$VENV" || exit 1
PY=$VENV/bin/python
SITE=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# The carried wheels go in first (before the machine's packages are visible, else pip takes
# the machine's mpi4py as already installed); they then come before the machine's on the path.
if ls .whl/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed \
        .whl/*.whl || exit 1
else
    echo "no .whl/ carried: the MPI steps need the mpich and mpi4py wheels (see the header)"
fi
echo "$BASE_SITE" > "$SITE/zz-machine-site.pth"
for p in smp-partition smp-comm smp-tp smp-pipeline smp-torch; do
    echo "$ROOT/packages/$p/src"
done > "$SITE/smp-sources.pth"
MPIEXEC=$VENV/bin/mpiexec
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1

$PY - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
import mpi4py, smp_comm, smp_pipeline
print("mpi4py", mpi4py.__version__, "smp_comm", smp_comm.__file__)
EOF

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, print its tail
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 20 "$OUT/$name.log"
    echo "== $name: rc=$rc in $((SECONDS - t0)) s"
}

step cuda-tests 240 $PY -m pytest -q -rs -p no:cacheprovider \
    packages/smp-comm/tests/test_cuda.py packages/smp-pipeline/tests/test_offload_devices.py
step bench-offload-cuda 120 env BENCH_OFFLOAD_DEVICE=cuda "$MPIEXEC" -n 2 $PY benchmarks/bench_offload.py
step bench-pipeline-1ms 150 env BENCH_PIPELINE_T=0.001 $PY benchmarks/bench_pipeline.py
if [ "${DEVICE_CHECKS_LONG:-0}" = 1 ]; then
    step bench-pipeline-20ms 300 env BENCH_PIPELINE_T=0.02 $PY benchmarks/bench_pipeline.py
fi
