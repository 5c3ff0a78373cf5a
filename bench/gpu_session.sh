#!/usr/bin/env bash
# Everything one lent-GPU call should do, in order: GPU facts, the test suite on CUDA (gpu-marked
# tests included), the forward timing in each dtype, the launch-overhead breakdown, and a real service
# smoke test in both modes. Timings are host-launch-bound at the shipped model's size and vary between
# processes: run it more than once before comparing (bench/results/forward_spread_h200.md).
# Usage on the device machine (after the wheel prologue of ../shared/gpu/README.md):
#   OUT=$OUT bash bench/gpu_session.sh [pytest args...]
set -uo pipefail
out=${OUT:-/tmp/fusedserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$out/gpu.txt"

# Deploy checks need hadolint/promtool (not on the GPU image); they run in CI instead.
timeout "${TEST_TIMEOUT:-420}" python3 -m pytest ${TESTS:-tests} -q -p no:cacheprovider -n "${XDIST:-8}" --dist loadfile \
  --ignore=tests/test_deploy_static.py --ignore=tests/test_prometheus_scrape.py "$@" > "$out/tests.txt" 2>&1 || status=1
tail -n 25 "$out/tests.txt"

for dt in float32 float16 bfloat16; do
  timeout 120 python3 -m bench.forward_timing --dtype "$dt" --out "$out" > "$out/timing_$dt.log" 2>&1 || status=1
done
cat "$out"/forward_*.md
timeout 120 python3 -m bench.launch_overhead --dtype float32 > "$out/launch_overhead_float32.txt" 2>&1 || status=1
cat "$out/launch_overhead_float32.txt"

timeout 300 python3 -m bench.smoke_service --device cuda > "$out/smoke.txt" 2>&1 || status=1
grep -E "accuracy|ready:|kernel_seconds_sum|exited|not ready|Error" "$out/smoke.txt"
exit $status
