#!/usr/bin/env bash
# Everything one lent-GPU call should do, in order: GPU facts, the test suite on CUDA (gpu-marked
# tests included), the kernel benchmark (fusedserve bench kernels), one-off probes, and a real service
# smoke test in both modes; `serve` adds the end-to-end load benchmark. Choose steps with STEPS (default
# "tests bench smoke").
# On a cold Triton cache the suite takes ~135 s with 16 workers and the whole benchmark ~545 s on an H200
# (torch.compile max-autotune is most of it), so they go in separate 600 s calls: STEPS="tests probe",
# then STEPS=bench (BENCH_LIMIT, default 535 s, bounds the benchmark; BENCH_ARGS adds flags, e.g.
# BENCH_ARGS="--sections models" for one part of a run split over two calls: bench/README.md, "Hot and cold").
# STEPS=probe runs `python -m bench.probes.P` for each P in $PROBE (space-separated; dashes or underscores;
# default digits-floor): bench/probes/README.md lists them.
# STEPS=zoo times zoo families (ZOO_FAMILIES, ZOO_LIMIT, ZOO_ARGS; see the step) into $OUT/zoo_<gpu>.json.
# STEPS=soak runs `fusedserve bench soak` for SOAK_MINUTES (default 5; ~6.5 min in all, a call of its own) and
# writes soak_<gpu>.md and .json to $OUT, for bench/results/<gpu>/.
# Usage on the device machine (after the wheel prologue of ../shared/gpu/README.md):
#   OUT=$OUT bash bench/gpu_session.sh [pytest args...]
set -uo pipefail
out=${OUT:-/tmp/fusedserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
steps=" ${STEPS:-tests bench smoke} "
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$out/gpu.txt"

if [[ $steps == *" tests "* ]]; then
  # Tuning off: every candidate config is tested explicitly, and timing 6-18 candidates per new shape
  # would triple the run. Deploy checks need hadolint/promtool (not on the GPU image); CI runs them.
  # Tests marked gpu_timing time the GPU: with 16 workers sharing it, another worker's kernels land inside their
  # windows (a digits-CNN replay read 300 us instead of 30), so they run afterwards, one at a time.
  export FUSEDSERVE_TUNING=false FUSEDSERVE_TUNING_CACHE=/tmp/fusedserve-test-tuning.json
  skip=(--ignore=tests/test_deploy_static.py --ignore=tests/test_prometheus_scrape.py)
  # SIGINT at the limit (then SIGKILL 30 s later): pytest stops as on Ctrl-C and still prints the failures' tracebacks
  # and its summary; a plain SIGTERM loses both (on a fresh machine the whole suite took more than 390 s on an H100).
  timeout -s INT -k 30 "${TEST_TIMEOUT:-420}" python3 -m pytest ${TESTS:-tests} -v -rfE --tb=short --durations=10 \
    -p no:cacheprovider -n "${XDIST:-16}" --dist load -m "not gpu_timing" "${skip[@]}" "$@" > "$out/tests.txt" 2>&1 \
    || status=1
  timeout -s INT -k 30 "${TIMING_TEST_TIMEOUT:-300}" python3 -m pytest ${TESTS:-tests} -v -rfE --tb=short -p no:cacheprovider \
    -p no:xdist -m gpu_timing "${skip[@]}" "$@" >> "$out/tests.txt" 2>&1
  case $? in 0|5) ;; *) status=1 ;; esac  # 5: TESTS named no timing test
  unset FUSEDSERVE_TUNING FUSEDSERVE_TUNING_CACHE
  # -v gives one line per test as it finishes, so a run cut off by the timeout still names its failures.
  grep -E " (FAILED|ERROR) |^(FAILED|ERROR)|passed|failed" "$out/tests.txt" | sort -u | tail -n 40
fi

if [[ $steps == *" bench "* ]]; then
  # The tuning cache goes to $OUT: it comes back, and says which config each shape got.
  FUSEDSERVE_TUNING_CACHE="$out/tuning.json" timeout $(( ${BENCH_LIMIT:-535} + 30 )) \
    python3 -m bench.kernels --time-limit "${BENCH_LIMIT:-535}" --out "$out" ${BENCH_ARGS:-} > "$out/bench.log" 2>&1 || status=1
  tail -n 45 "$out/bench.log"
fi

if [[ $steps == *" probe "* ]]; then
  for probe in ${PROBE:-digits-floor}; do  # one or more, space-separated; each its own log
    timeout "${PROBE_TIMEOUT:-240}" python3 -m "bench.probes.${probe//-/_}" --out "$out" > "$out/probe_$probe.txt" 2>&1 \
      || status=1
    grep -v -i "warning" "$out/probe_$probe.txt" | tail -n 40
  done
fi

if [[ $steps == *" serve "* ]]; then
  # The end-to-end load benchmark (fusedserve bench serve); SERVE_BUDGET bounds it, SERVE_ARGS narrows it.
  timeout $(( ${SERVE_BUDGET:-510} + 60 )) python3 -m bench.serve --time-budget "${SERVE_BUDGET:-510}" --out "$out" \
    ${SERVE_ARGS:-} > "$out/serve.log" 2>&1 || status=1
  tail -n 30 "$out/serve.log"
fi

if [[ $steps == *" zoo "* ]]; then
  # The zoo's timing (fusedserve bench zoo --gpu) of ZOO_FAMILIES (comma-separated; default: the families the committed
  # results have not timed, and ShuffleNetV2), merged into a copy of the committed results so that $OUT's zoo_<gpu>.json
  # replaces bench/results/<gpu>/'s. A family takes 1-4 minutes (GoogLeNet 255 s on an H200); ZOO_LIMIT bounds the
  # step, and every family finished before it is kept. ZOO_ARGS adds flags (--providers, --steps N, --max-autotune F).
  slug=$(python3 -c "import torch; from bench.gpu import slug_of; print(slug_of(torch.cuda.get_device_name()))")
  [ -f "bench/results/$slug/zoo_$slug.json" ] && cp "bench/results/$slug/zoo_$slug.json" "$out/"
  timeout "${ZOO_LIMIT:-540}" python3 -m bench.zoo --gpu \
    --families "${ZOO_FAMILIES:-shufflenet_v2_x1_0,wide_resnet50_2,efficientnet_v2_s}" --out "$out" ${ZOO_ARGS:-} \
    > "$out/zoo.log" 2>&1 || status=1
  grep -v -i "warning" "$out/zoo.log" | tail -n 30
fi

if [[ $steps == *" smoke "* ]]; then
  timeout 300 python3 -m bench.smoke_service --device cuda > "$out/smoke.txt" 2>&1 || status=1
  grep -E "accuracy|ready:|kernel_seconds_sum|exited|not ready|Error" "$out/smoke.txt"
fi
if [[ $steps == *" soak "* ]]; then
  minutes=${SOAK_MINUTES:-5}
  timeout $(( ${minutes%.*} * 60 + 240 )) python3 -m bench.soak --minutes "$minutes" --out "$out" > "$out/soak.log" 2>&1 \
    || status=1
  tail -n 45 "$out/soak.log"
fi
exit $status
