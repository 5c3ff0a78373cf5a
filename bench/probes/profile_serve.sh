#!/usr/bin/env bash
# Probe: where does a loaded front end, and the engine, spend its time? `bench serve` runs fused@N at 256
# single-row connections for DURATION s while py-spy samples front end 0 and engine 0 (raw stacks, summed by
# bench/probes/profile_summary.py). Run on the GPU host from the repo root; writes $OUT/profile_*.
set -u
OUT=${OUT:-/tmp/profile}; mkdir -p "$OUT"
DURATION=${DURATION:-10}
TUNING_CACHE=${TUNING_CACHE:-/tmp/fusedserve-tuning.json}
pid_of() { for p in /proc/[0-9]*; do [ "$(cat "$p/comm" 2>/dev/null)" = "$1" ] && basename "$p" && return; done; }
(
  # Wait for the bench's server to be up and loaded, then sample both processes at once.
  for _ in $(seq 1 600); do [ -f "$OUT/.loaded" ] && break; sleep 0.5; done
  fe=$(pid_of fs-frontend-0); en=$(pid_of fs-engine-0)
  sleep 2
  py-spy record -p "$fe" -d 4 -r 400 -f raw -o "$OUT/profile_frontend.txt" --nonblocking > /dev/null 2>&1 &
  py-spy record -p "$en" -d 4 -r 400 -f raw -o "$OUT/profile_engine.txt" --nonblocking > /dev/null 2>&1 &
  wait
) &
sampler=$!
python3 -m bench.serve --systems fused@N --connections 256 --rows 1 --duration "$DURATION" --no-open --no-sigterm \
  --tuning-cache "$TUNING_CACHE" --out "$OUT/profile_run" > "$OUT/profile_bench.log" 2>&1 &
bench=$!
# The sampler starts once the server is ready and the phase has begun: the bench logs readiness first.
for _ in $(seq 1 600); do grep -q "ready in" "$OUT/profile_bench.log" 2>/dev/null && break; sleep 0.5; done
sleep 1.5; touch "$OUT/.loaded"
wait $bench; wait $sampler
tail -5 "$OUT/profile_bench.log"
for f in frontend engine; do echo "== $f"; python3 bench/probes/profile_summary.py "$OUT/profile_$f.txt" | head -40; done
