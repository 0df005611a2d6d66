#!/bin/bash
# The acceptance vectors tree sizing reads (Sequoia / hardware-aware trees), per temperature, written into a
# trained draft's folder as acceptance.json. Usage (repository root, `.venv` active): scripts/draft_acceptance.sh DRAFT
# (draft_recipe.sh and draft_finetune.sh call it for their EDD; the per-temperature files stay beside DRAFT).
set -euo pipefail
DRAFT=$1
for T in 0.0 0.6 1.0; do
  spectot tree measure --draft "$DRAFT" --width 8 --temperature $T --out "$DRAFT/../acceptance_$T.json" > /dev/null
done
python - "$DRAFT" <<'PY'
import json, sys
draft = sys.argv[1]
table = {t: json.load(open(f"{draft}/../acceptance_{t}.json"))["acceptance"] for t in ("0.0", "0.6", "1.0")}
record = {
    "acceptance": table["0.0"],
    "temperature": 0.0,
    "source": "spectot tree measure --draft edd --width 8 --temperature T (T = 0, 0.6, 1; 8 GSM8K test questions "
    "from offset 100, 128 new tokens each)",
    "acceptance_by_temperature": table,
}
json.dump(record, open(f"{draft}/acceptance.json", "w"), indent=1)
PY
