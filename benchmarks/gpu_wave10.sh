#!/usr/bin/env bash
# nvidia-h200 calls for [adaptive] (wave 10: the bars on the tree of wave 9, STOP_AFTER and the
# rest that goes on while every request is cold; wave 9's raw files were lost with its machine).
#   bash benchmarks/gpu_wave10.sh bars   the bundled bar three times, then the 8B shape with a
#                                        dummy EAGLE-3 head (plain, auto)   ~450 s
#   bash benchmarks/gpu_wave10.sh hold   (after ONE_ROW_STAY_MARGIN 1.1) the bundled bar twice, then
#                                        EAGLE-3 at bs 1 and 8 beside the rule before it
#                                        (adaptive_variants.py, old:ONE_ROW_STAY_MARGIN=1.2) ~350 s
#   bash benchmarks/gpu_wave10.sh final  (the same tree) the 8B shape with the dummy head, then the
#                                        realistic job with it                ~420 s
#   bash benchmarks/gpu_wave10.sh job    the realistic job with the dummy head (workload.py,
#                                        1,000 requests: plain, auto, plain, auto), then the
#                                        bundled bar twice                  ~500 s
# Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
source "$(dirname "$0")/gpu_bar_lib.sh"
cd "$(dirname "$0")"
BAR_TIMEOUT=110
LOG="$OUT/wave10_$1.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG"
job() {
    timeout 280 python3 workload.py --out "$OUT/wl" --requests 1000 \
        --configs default,eagle3_auto,default,eagle3_auto --timeout 100 2>&1 \
        | grep -v Warning | tail -8 | tee -a "$LOG"
}
if [ "$1" = final ]; then
    EIGHTB_TIMEOUT=130 eightb "$LOG"
    job
elif [ "$1" = bars ]; then
    bar 1 "$LOG"
    bar 2 "$LOG"
    bar 3 "$LOG"
    EIGHTB_TIMEOUT=130 eightb "$LOG"
elif [ "$1" = hold ]; then
    bar 6 "$LOG"
    bar 7 "$LOG"
    timeout 150 python3 adaptive_variants.py --json "$OUT/variants.json" --drafters eagle3 \
        --sizes 1,8 --rounds 31 --variant old:ONE_ROW_STAY_MARGIN=1.2 2>&1 | grep -v Warning \
        | tail -3 >> "$LOG"
    python3 -c "
import json; print(json.dumps(json.load(open('$OUT/variants.json'))['verdict']))" | tee -a "$LOG"
else
    job
    bar 4 "$LOG"
    bar 5 "$LOG"
fi
