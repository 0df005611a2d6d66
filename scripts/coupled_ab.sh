#!/bin/bash
# Coupled guesses on and off: one stream, the EDD's adaptive chains against plain decoding at temperature 1 and
# at 0.8 with top-p 0.95, on the same GSM8K questions, one method after another in one run (the machine's
# speed drifts: compare within a run). Every method emits the same tokens for a setting (checked).
# Usage (repository root, `.venv` active):
#   scripts/coupled_ab.sh [N_PROMPTS] [OUT]     (defaults: 8, docs/results/coupled_ab)
# Writes OUT/<method>_<setting>.jsonl (per-prompt stats) and OUT/results.md.
set -euo pipefail
N=${1:-8}
OUT=${2:-docs/results/coupled_ab}
DATA=${DATA:-../shared/data/gsm8k/test.jsonl}
mkdir -p "$OUT"
for setting in T1 T0.8p0.95; do
  case $setting in
    T1) sampling=(--temperature 1) ;;
    T0.8p0.95) sampling=(--temperature 0.8 --top-p 0.95) ;;
  esac
  for method in ar argmax coupled; do
    case $method in
      ar) args=(--method ar) ;;
      argmax) args=(--draft edd --no-coupled) ;;
      coupled) args=(--draft edd --coupled) ;;
    esac
    spectot generate "${args[@]}" "${sampling[@]}" --prompts "$DATA" --field question --limit "$N" \
      --max-new-tokens 128 --seed 1 --json 2> /dev/null | grep '^{' > "$OUT/${method}_$setting.jsonl"
  done
done
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = ["| sampling | method | tokens/s | speedup vs ar | tokens/step | draft ms/step | verify ms/step | same tokens as ar |",
        "|---|---|---:|---:|---:|---:|---:|---:|"]
for setting in ("T1", "T0.8p0.95"):
    base, ar_tokens = None, None
    for method in ("ar", "argmax", "coupled"):
        records = [json.loads(line) for line in open(out / f"{method}_{setting}.jsonl")]
        stats = [r["stats"] for r in records]
        tokens = [r["token_ids"] for r in records]
        ar_tokens = ar_tokens or tokens
        total = {k: sum(s[k] for s in stats) for k in ("new_tokens", "target_forwards", "time_draft", "time_verify", "time_total")}
        speed = total["new_tokens"] / total["time_total"]
        base = base or speed
        steps = total["target_forwards"]
        same = sum(a == b for a, b in zip(tokens, ar_tokens))
        rows.append(f"| {setting} | {method} | {speed:.1f} | {speed / base:.2f}x | {total['new_tokens'] / steps:.2f} | "
                    f"{1000 * total['time_draft'] / steps:.2f} | {1000 * total['time_verify'] / steps:.2f} | "
                    f"{same}/{len(tokens)} |")
(out / "results.md").write_text("\n".join(rows) + "\n")
print((out / "results.md").read_text())
PY
