# Sourced by the gpu_wave8_*.sh / wave9 / wave10 scripts: `bar NAME LOG` runs the bundled bar once
# (adaptive_gpu.py --parts bundled, from benchmarks/) into $OUT/adaptive_NAME.json and appends
# its paired verdict to LOG; `eightb LOG [RUNS]` the 8B shape with a dummy EAGLE-3 head
# (--parts 8b, RUNS default plain,auto) into $OUT/adaptive_8b.json, its ratios to LOG.
bar() {
    timeout "${BAR_TIMEOUT:-120}" python3 adaptive_gpu.py --json "$OUT/adaptive_$1.json" \
        --parts bundled 2>&1 | grep -v Warning | tail -3 >> "$2"
    python3 -c "
import json; d = json.load(open('$OUT/adaptive_$1.json'))
print(json.dumps({k: v['paired_auto_vs_best'] for k, v in d.get('bundled_verdict').items()}))" \
        | tee -a "$2"
}

eightb() {
    timeout "${EIGHTB_TIMEOUT:-150}" python3 adaptive_gpu.py --json "$OUT/adaptive_8b.json" \
        --parts 8b --runs-8b "${2:-plain,auto}" 2>&1 | grep -v Warning | tail -3 >> "$1"
    python3 -c "
import json; d = json.load(open('$OUT/adaptive_8b.json'))['8b']
print(json.dumps({n: {b: d[n][b].get('vs_plain', d[n][b]['tok_s']) for b in ('bs1', 'bs64')}
                  for n in d if 'bs1' in d[n]}))" | tee -a "$1"
}
