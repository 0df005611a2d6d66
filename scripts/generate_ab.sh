#!/bin/bash
# One stream, several `spectot generate` methods at several sampling settings on the same GSM8K questions, one
# method after another in one run (the machine's speed drifts: compare within a run). The first method of a
# setting is the baseline of its rows, and every row says how many outputs equal the baseline's.
# Usage (repository root, `.venv` active):
#   SETTINGS="name:flags;..." METHODS="name:flags;..." scripts/generate_ab.sh N_PROMPTS OUT
# e.g. SETTINGS="T1:--temperature 1" METHODS="ar:--method ar;edd:--draft edd" scripts/generate_ab.sh 8 runs/ab
# Writes OUT/<method>_<setting>.jsonl (per-prompt stats) and OUT/results.md. Wrappers: adaptive_width.sh,
# coupled_ab.sh.
set -euo pipefail
N=${1:?usage: SETTINGS=... METHODS=... scripts/generate_ab.sh N_PROMPTS OUT}
OUT=${2:?usage: SETTINGS=... METHODS=... scripts/generate_ab.sh N_PROMPTS OUT}
: "${SETTINGS:?set SETTINGS=\"name:flags;...\" (sampling settings, e.g. \"T1:--temperature 1\")}"
: "${METHODS:?set METHODS=\"name:flags;...\" (methods, e.g. \"ar:--method ar;edd:--draft edd\")}"
DATA=${DATA:-../shared/data/gsm8k/test.jsonl}
mkdir -p "$OUT"
IFS=';' read -ra settings <<< "$SETTINGS"
IFS=';' read -ra methods <<< "$METHODS"
for setting in "${settings[@]}"; do
  for method in "${methods[@]}"; do
    # shellcheck disable=SC2086  # the flags split into words on purpose
    spectot generate ${method#*:} ${setting#*:} --prompts "$DATA" --field question --limit "$N" \
      --max-new-tokens 128 --seed 1 --json 2> /dev/null | grep '^{' > "$OUT/${method%%:*}_${setting%%:*}.jsonl"
  done
done
python - "$OUT" "$SETTINGS" "$METHODS" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
settings = [s.split(":", 1)[0] for s in sys.argv[2].split(";")]
methods = [m.split(":", 1)[0] for m in sys.argv[3].split(";")]
rows = ["| setting | method | tokens/s | speedup | tokens/step | draft ms/step | verify ms/step | same tokens as the first |",
        "|---|---|---:|---:|---:|---:|---:|---:|"]
keys = ("new_tokens", "target_forwards", "time_draft", "time_verify", "time_total")
for setting in settings:
    base, first = None, None
    for method in methods:
        records = [json.loads(line) for line in open(out / f"{method}_{setting}.jsonl")]
        total = {k: sum(r["stats"][k] for r in records) for k in keys}
        tokens = [r["token_ids"] for r in records]
        first = first or tokens
        speed = total["new_tokens"] / total["time_total"]
        base = base or speed
        steps = total["target_forwards"]
        same = sum(a == b for a, b in zip(tokens, first))
        rows.append(f"| {setting} | {method} | {speed:.1f} | {speed / base:.2f}x | {total['new_tokens'] / steps:.2f} | "
                    f"{1000 * total['time_draft'] / steps:.2f} | {1000 * total['time_verify'] / steps:.2f} | "
                    f"{same}/{len(tokens)} |")
(out / "results.md").write_text("\n".join(rows) + "\n")
print((out / "results.md").read_text())
PY
