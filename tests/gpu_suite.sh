#!/usr/bin/env bash
# The test suite on a GPU host, in parts that each finish well inside one 600 s device call (issue 37).
#
#   bash tests/gpu_suite.sh PART            on the GPU host (after the wheel prologue of ../shared/gpu/README.md)
#   bash tests/gpu_suite.sh record DIR...   here: the parts' files, fetched into DIR..., into one record per GPU,
#                                           bench/results/<gpu>/gpu_tests_<gpu>.txt (bench/README.md's index has it)
#
# PART       what                                                                           expected (cold caches,
#                                                                                           16 workers, H100/H200)
# kernels-a  the kernels' every-candidate sweeps: the `sweep` marker, which tests/sweeps.py     ~250-330 s; its longest
#            sets by name on tests/test_kernels_*.py (227 tests), the longest first             test ~230 s (pool's)
# kernels-b  every other test of tests/test_kernels_*.py, test_launch, test_pdl, test_tuning    ~150-250 s
#            (1,436 tests; 588 of them gpu-marked, the rest run compiled on CUDA too)
# service    the rest of tests/ (1,828: model format, executors, graphs, the service end to      ~150-250 s, then
#            end, v2, bench), then the `gpu_timing` tests alone, one at a time                  ~30-90 s
# two-gpu    test_multiprocess.py's two-GPU test, on a host of two GPUs (nvidia-h100-x2 or      ~60-120 s
#            nvidia-h200-x2; it skips below two)
# all        kernels-a, kernels-b, service in order, and their record: ~12-15 min, so only where one command may
#            run that long (not in the lent machines' 600 s calls)
# The estimates come from the single-run logs in bench/results/<gpu>/gpu_tests_*.txt (the whole suite, cut off at 390 s
# on an H100 with ~50 sweeps unreached; 611 kernel tests in 282 s on an H200; pool's sweep 226 s alone).
#
# Each part runs under `timeout -s INT` (PART_LIMIT, default 510 s, then SIGKILL 20 s later; in `service` the
# parallel run gets PART_LIMIT less TIMING_LIMIT, default 180 s, and the gpu_timing run what is left): on SIGINT
# pytest stops as on Ctrl-C and still prints its failures and summary, and -v has already named every test that
# finished. Everything goes to $OUT/gpu_tests_<part>.txt (OUT defaults to /tmp/fusedserve-gpu): a header (GPU,
# driver, torch, triton, commit), each pytest command, its output with the tests over 5 s (--durations), and one
# line per pytest run, `# summary <part> <run>: ...`, printed again at the end. `all` also writes
# $OUT/gpu_tests.txt: what `record` makes of the three parts.
#
# Knobs (environment): XDIST (workers, default 16), PART_LIMIT, TIMING_LIMIT, COMMIT (the commit to name in the
# header where the tree has no .git, as on the device machine), and pytest arguments after PART.
# Tuning is off (FUSEDSERVE_TUNING=false) as in bench/gpu_session.sh: the sweeps force every candidate themselves,
# and timing 6-18 candidates per new shape would triple the run. The Docker/Prometheus checks (hadolint, promtool:
# not on the GPU image) are left to CI. Needs pytest-xdist >= 3.2 (--maxschedchunk); the GPU image has 3.8.
set -uo pipefail
cd "$(dirname "$0")/.."

part=${1:-}
[[ $# -gt 0 ]] && shift

record() {  # record OUT FILE...: the part files of one GPU, merged with a header of their summary lines
  local out=$1 gpu first
  shift
  gpu=$(sed -n 's/^# gpu: \([^ ]*\).*/\1/p' "$1" | head -n 1)
  for f in "$@"; do
    first=$(sed -n 's/^# gpu: \([^ ]*\).*/\1/p' "$f" | head -n 1)
    [[ $first == "$gpu" ]] || { echo "$f is from GPU '$first', $1 from '$gpu': one record per GPU" >&2; return 1; }
  done
  {
    echo "# The GPU test suite (tests/gpu_suite.sh, tests/README.md), on one $gpu host: $# parts"
    sed -n '/^# gpu: /{p;q}' "$1"
    grep -h '^# commit: ' "$@" | sort -u
    grep -h '^# summary ' "$@"
    for f in "$@"; do
      echo
      echo "########## $(basename "$f")"
      cat "$f"
    done
  } > "$out"
  echo "$out"
  grep -h '^# summary ' "$@"
}

if [[ $part == record ]]; then
  [[ $# -gt 0 ]] || { echo "usage: $0 record DIR... (folders holding gpu_tests_<part>.txt)" >&2; exit 2; }
  files=()
  for d in "$@"; do
    for p in kernels-a kernels-b service two-gpu; do
      [[ -f $d/gpu_tests_$p.txt ]] && files+=("$d/gpu_tests_$p.txt")
    done
  done
  [[ ${#files[@]} -gt 0 ]] || { echo "no gpu_tests_<part>.txt in $*" >&2; exit 2; }
  gpu=$(sed -n 's/^# gpu: \([^ ]*\).*/\1/p' "${files[0]}" | head -n 1)
  [[ -n $gpu ]] || { echo "${files[0]}: no '# gpu:' line" >&2; exit 2; }
  mkdir -p "bench/results/$gpu"
  record "bench/results/$gpu/gpu_tests_$gpu.txt" "${files[@]}"
  exit $?
fi

case $part in
  kernels-a | kernels-b | service | two-gpu | all) ;;
  *)
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac

out=${OUT:-/tmp/fusedserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FUSEDSERVE_TUNING=false FUSEDSERVE_TUNING_CACHE=/tmp/fusedserve-test-tuning.json
xdist=${XDIST:-16}
limit=${PART_LIMIT:-510}
kernel_files=(tests/test_kernels_*.py tests/test_launch.py tests/test_pdl.py tests/test_tuning.py)
ci_only=(--ignore=tests/test_deploy_static.py --ignore=tests/test_prometheus_scrape.py)  # hadolint, promtool
common=(-v -rfE --tb=short -p no:cacheprovider --durations=30 --durations-min=5)
# One test at a time per worker beyond the first two (tests/sweeps.py): a long sweep never queues behind another.
spread=(-n "$xdist" --dist load --maxschedchunk 1)

# The GPU's short name as every benchmark writes it (bench/gpu.py): 'NVIDIA H100 80GB HBM3' -> h100, no GPU -> cpu
read -r gpu gpu_name < <(python3 -c "from bench.gpu import gpu_name, slug_of; n = gpu_name(); print(slug_of(n), n)")
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

header() {  # header FILE PART
  {
    echo "# gpu: $gpu ($gpu_name; $(nvidia-smi --query-gpu=count --format=csv,noheader 2>/dev/null | head -n 1) GPU(s)," \
      "driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1))"
    echo "# part: $2, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, $xdist xdist workers, limit ${limit} s"
    echo "# commit: $commit"
    python3 -c "import torch, triton, pytest; print('# torch', torch.__version__, 'triton', triton.__version__, 'pytest', pytest.__version__)"
  } > "$1"
}

summarize() {  # summarize FILE PART WHAT RC LIMIT: one '# summary' line for the last pytest run in FILE
  local file=$1 part=$2 what=$3 rc=$4 state
  case $rc in
    0) state="ok" ;;
    5) state="ok (no tests selected)" ;;
    124 | 137) state="CUT OFF at the $5 s limit" ;;
    *) state="FAILED (exit $rc)" ;;
  esac
  # pytest's own last line, and -v's one line per finished test ("[gw3] [ 41%] PASSED tests/..." under xdist,
  # "tests/... PASSED [ 41%]" without) counted: they say how far a cut-off run got. Over this run's lines only.
  echo "# summary $part $what: $state; $(python3 - "$file" <<'PY'
import collections, re, sys
run = open(sys.argv[1], errors="replace").read().rsplit("\n# command: ", 1)[-1]
ends = re.findall(r"^=+ (.*(?:passed|failed|error|skipped|deselected|no tests ran).* in [\d.]+s.*?) =+$", run, re.M)
word = r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
xdist = re.findall(rf"^\[gw\d+\] \[ *\d+%\] {word} tests/", run, re.M)
plain = re.findall(rf"^tests/\S.*::.* {word}(?: |$)", run, re.M)
counts = ", ".join(f"{n} {k.lower()}" for k, n in collections.Counter(xdist + plain).most_common())
print(f"pytest: {ends[-1] if ends else 'no summary line'}; per test: {counts or 'none'}")
PY
)" >> "$file"
}

run_pytest() {  # run_pytest FILE PART WHAT LIMIT pytest-args...: appends to FILE, returns pytest's (or timeout's) rc
  local file=$1 part=$2 what=$3 lim=$4 rc start
  shift 4
  echo "# command: python3 -m pytest $(printf '%q ' "$@")" >> "$file"
  if [[ $lim -lt 30 ]]; then  # (timeout 0 would mean no limit at all)
    echo "# summary $part $what: NOT RUN, ${lim} s left of the part's limit" >> "$file"
    return 124
  fi
  start=$SECONDS
  timeout -s INT -k 20 "$lim" python3 -m pytest "$@" >> "$file" 2>&1
  rc=$?
  echo "# $what: exit $rc after $((SECONDS - start)) s" >> "$file"
  summarize "$file" "$part" "$what" "$rc" "$lim"
  return $rc
}

status=0
run_part() {  # run_part PART [pytest args...]
  local p=$1 file rc
  shift
  file=$out/gpu_tests_$p.txt
  header "$file" "$p"
  case $p in
    kernels-a)
      # The longest sweep took 226 s alone: pytest's per-test limit (300 s, pyproject.toml) raised for this part.
      run_pytest "$file" "$p" "sweeps" "$limit" "${kernel_files[@]}" -m "sweep and not gpu_timing" --timeout 480 \
        "${spread[@]}" "${common[@]}" "$@"
      rc=$?
      ;;
    kernels-b)
      run_pytest "$file" "$p" "kernels" "$limit" "${kernel_files[@]}" -m "not sweep and not gpu_timing" \
        "${spread[@]}" "${common[@]}" "$@"
      rc=$?
      ;;
    service)
      local ignore=() start=$SECONDS timing=${TIMING_LIMIT:-180}
      for f in "${kernel_files[@]}"; do ignore+=("--ignore=$f"); done
      # --dist load's default chunks: consecutive tests of a module share a worker, and its servers, more often.
      # Both runs share the part's limit: the parallel one leaves TIMING_LIMIT to the timing one.
      run_pytest "$file" "$p" "parallel" "$((limit - timing))" tests "${ignore[@]}" "${ci_only[@]}" \
        -m "not sweep and not gpu_timing" -n "$xdist" --dist load "${common[@]}" "$@"
      rc=$?
      # Tests that time the GPU: with 16 workers sharing it, another's kernels land inside their windows; alone.
      run_pytest "$file" "$p" "gpu_timing" "$((limit - (SECONDS - start)))" tests "${ci_only[@]}" -m gpu_timing \
        -p no:xdist "${common[@]}" "$@"
      case $? in 0 | 5) ;; *) rc=1 ;; esac
      ;;
    two-gpu)
      run_pytest "$file" "$p" "two-gpu" "$limit" tests/test_multiprocess.py -k one_engine_per_gpu -p no:xdist \
        "${common[@]}" -rs "$@"
      rc=$?
      ;;
  esac
  case $rc in 0 | 5) ;; *) status=1 ;; esac
  # Failures and errors by name, whatever stopped the run.
  grep -E '^(FAILED|ERROR) tests/|\] (FAILED|ERROR) tests/|^tests/.*::.* (FAILED|ERROR)( |$)' "$file" | sort -u | head -n 40
}

if [[ $part == all ]]; then
  parts=(kernels-a kernels-b service)
else
  parts=("$part")
fi
for p in "${parts[@]}"; do run_part "$p" "$@"; done
for p in "${parts[@]}"; do grep -h '^# summary ' "$out/gpu_tests_$p.txt"; done
if [[ $part == all ]]; then
  record "$out/gpu_tests.txt" "$out"/gpu_tests_{kernels-a,kernels-b,service}.txt > /dev/null
  echo "record: $out/gpu_tests.txt (for bench/results/$gpu/gpu_tests_$gpu.txt)"
fi
exit $status
