#!/usr/bin/env bash
# one-off device call (not committed)
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
FUSEDSERVE_TUNING=false FUSEDSERVE_TUNING_CACHE=/tmp/t.json timeout -s INT -k 10 ${TT:-140} python3 -m pytest tests/test_kernels_conv.py tests/test_kernels_pool.py tests/test_executors.py tests/test_kernels_linear.py -m gpu -q -n 16 -p no:cacheprovider > $OUT/tests.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests.txt | tail -n 8
FUSEDSERVE_TUNING_CACHE=$OUT/tuning.json timeout $(( ${BL:-420} + 25 )) python3 -m bench.kernels $BARGS --time-limit ${BL:-420} --out $OUT > $OUT/bench.log 2>&1
grep -E "^(not met|==)|wrote|skip" $OUT/bench.log | tail -n 30
rm -f $OUT/*.png
ls $OUT
