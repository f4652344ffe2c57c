#!/bin/bash
# One GPU session's checks, in one command on the device machine (docs/cuda.md, "Running on a GPU"):
# the GPU tests, the decode benchmark and one ncu look at decode_split. Logs and JSON under $OUT (default ./gpu-out).
#
# The device image has torch, pytest, safetensors and rich but older transformers and its own cuda-core; kvcal's pins
# travel as wheels in .whl/ (git-ignored), made on the development machine with
#   for p in transformers==5.24.0 gguf==0.19.0 cuda-core==1.2.2 cuda-bindings==13.4.4 cuda-pathfinder==1.9.1 \
#            cuda-python==13.4.4; do python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl $p; done
# and the device tool's `run` with carry [".whl"] and command `bash experiments/gpu_session.sh` (about 4 minutes).
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 3
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout "${TEST_S:-200}" python3 -m pytest -m gpu -rs -q -p no:cacheprovider --tb=short tests > "$OUT/gpu-tests.log" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -2
grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -30
timeout "${BENCH_S:-200}" python3 experiments/cuda_decode.py --json "$OUT/cuda_decode.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; tail -52 "$OUT/bench.log" | cut -c1-250
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ]; then
  timeout "${NCU_S:-100}" "$NCU" --clock-control none -k regex:decode_split --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    python3 experiments/cuda_decode.py --no-gpu-time --geometries "llama-3-8b shape" --contexts 32768 --batches 16 \
    --pairs K8V4/K4cV2 --iters 2 > "$OUT/ncu.log" 2>&1
  echo "ncu rc=$?"
  grep -E "Throughput|Duration|Occupancy|Registers|Grid Size|Waves" "$OUT/ncu.log" | head -20
fi
