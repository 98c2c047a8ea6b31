# Sourced by the gpu_wave8_*.sh scripts: `bar NAME LOG` runs the bundled bar once
# (adaptive_gpu.py --parts bundled, from benchmarks/) into $OUT/adaptive_NAME.json and appends
# its paired verdict to LOG.
bar() {
    timeout "${BAR_TIMEOUT:-120}" python3 adaptive_gpu.py --json "$OUT/adaptive_$1.json" \
        --parts bundled 2>&1 | grep -v Warning | tail -3 >> "$2"
    python3 -c "
import json; d = json.load(open('$OUT/adaptive_$1.json'))
print(json.dumps({k: v['paired_auto_vs_best'] for k, v in d.get('bundled_verdict').items()}))" \
        | tee -a "$2"
}
