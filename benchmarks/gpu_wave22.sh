#!/usr/bin/env bash
# Wave 22 (2026-12-06, issue 24): FP8 routes borrowed where kernels/fp8_tuned.json has no exact
# row (the nearest measured shape, then a GPU of the same compute capability; fp8_table.py).
# PHASE=borrow (default): the GPU tests of every route this GPU takes, then the FP8 graph decode
# step with the shipped table exact-only vs borrowing, on the Llama-3.1-8B shape (bf16 beside
# it) and on the Qwen3-8B shape (gate_up / down shapes no table measured).
# PHASE=sweep: this GPU's rows at M > 1 (fp8_sweep.py --merge), then the step with them vs the
# shipped table. Logs and JSON under $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh"
machine_header
if [ "${PHASE:-borrow}" = borrow ]; then
    timeout 150 python3 -m pytest -q -m gpu tests/test_fp8_kernels.py -p no:cacheprovider \
        -k "routes_on_this_gpu or scaled_mm_layout" 2>&1 | tail -4 | tee "$OUT/wave22_pytest.log"
    timeout 200 python3 benchmarks/decode_ab.py --label w22 --kinds fp8,bf16 --rounds 3 \
        --fp8-tables "shipped@exact;shipped" --json "$OUT/wave22_ab_llama8b.json" 2>&1 \
        | grep -v "Warning\|it/s\]\|warn" | tee "$OUT/wave22_ab_llama8b.log" | tail -6
    timeout 200 python3 benchmarks/decode_ab.py --label w22q --shape qwen3_8b --kinds fp8 \
        --rounds 3 --fp8-tables "shipped@exact;shipped" --json "$OUT/wave22_ab_qwen3.json" 2>&1 \
        | grep -v "Warning\|it/s\]\|warn" | tee "$OUT/wave22_ab_qwen3.log" | tail -6
else
    timeout 250 python3 benchmarks/fp8_sweep.py --ms "${MS:-64,4,2,8,16,32,128,256,3,24,40}" \
        --merge --skip-decode --budget-s 230 --json "$OUT/wave22_sweep.json" \
        --table "$OUT/wave22_table.json" 2>&1 | grep -v "it/s\]" | tee "$OUT/wave22_sweep.log" \
        | tail -16
    timeout 200 python3 benchmarks/decode_ab.py --label w22s --kinds fp8 --rounds 3 \
        --fp8-tables "shipped;$OUT/wave22_table.json" --json "$OUT/wave22_ab_swept.json" 2>&1 \
        | grep -v "Warning\|it/s\]\|warn" | tee "$OUT/wave22_ab_swept.log" | tail -6
fi
exit 0
