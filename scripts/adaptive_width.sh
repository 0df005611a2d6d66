#!/bin/bash
# One stream, the EDD's adaptive draft with and without runner-up fans against plain decoding, greedy and at
# temperature 1, on the same GSM8K questions, one method after another in one run (the machine's speed drifts:
# compare within a run). Usage (repository root, `.venv` active):
#   scripts/adaptive_width.sh [N_PROMPTS] [OUT]     (defaults: 8, docs/results/adaptive_width)
# Writes OUT/<method>_T<temperature>.jsonl (per-prompt stats) and OUT/results.md.
set -euo pipefail
N=${1:-8}
OUT=${2:-docs/results/adaptive_width}
DATA=${DATA:-../shared/data/gsm8k/test.jsonl}
mkdir -p "$OUT"
for T in 0 1; do
  for method in ar width1 width4; do
    case $method in
      ar) args=(--method ar) ;;
      width1) args=(--draft edd --draft-width 1) ;;
      width4) args=(--draft edd --draft-width 4) ;;
    esac
    spectot generate "${args[@]}" --prompts "$DATA" --field question --limit "$N" --max-new-tokens 128 \
      --temperature $T --seed 1 --json 2> /dev/null | grep '^{' > "$OUT/${method}_T$T.jsonl"
  done
done
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = ["| temperature | method | tokens/s | speedup vs ar | tokens/step | draft ms/step | verify ms/step |",
        "|---:|---|---:|---:|---:|---:|---:|"]
for t in ("0", "1"):
    base = None
    for method in ("ar", "width1", "width4"):
        stats = [json.loads(line)["stats"] for line in open(out / f"{method}_T{t}.jsonl")]
        total = {k: sum(s[k] for s in stats) for k in ("new_tokens", "target_forwards", "time_draft", "time_verify", "time_total")}
        speed = total["new_tokens"] / total["time_total"]
        base = base or speed
        steps = total["target_forwards"]
        rows.append(f"| {t} | {method} | {speed:.1f} | {speed / base:.2f}x | {total['new_tokens'] / steps:.2f} | "
                    f"{1000 * total['time_draft'] / steps:.2f} | {1000 * total['time_verify'] / steps:.2f} |")
(out / "results.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
