#!/bin/bash
# Stage 4 of the EDD for smollm2-135m: the next-token draft of stage 3 (runs/draft_next/edd, FROM=...) also given
# each entry's own token (`train-draft --current-token`, at zero weight to start), so one entry holds both the key
# of a copy (x_i) and its value (x_{i+1}). Stage 2's corpus again, with the Creative Writing files, where the target
# restates its given sentences, repeated CW_REPEAT times in all. Run from the repository root after
# scripts/draft_finetune.sh and scripts/draft_next_token.sh (their corpus and features are reused: no new target
# pass). Writes runs/draft_copy/edd; resumes where it stopped (rerun the script).
set -euo pipefail
. .venv/bin/activate
STAGE2=runs/draft_finetune
WORK=runs/draft_copy
FROM=${FROM:-runs/draft_next/edd}
EPOCHS=${EPOCHS:-1}
CW_REPEAT=${CW_REPEAT:-4}
mkdir -p $WORK
CORPUS=""
for f in self_gsm3 tot_gsm2.step1 tot_gsm2.step2 tot_gsm2.step3 tot_gsm2.step4; do
  CORPUS="$CORPUS --corpus $STAGE2/$f.jsonl"
done
for _ in $(seq "$CW_REPEAT"); do
  CORPUS="$CORPUS --corpus $STAGE2/self_cw.jsonl --corpus $STAGE2/self_cw_t1_s4.jsonl"
done
spectot train-draft $CORPUS --init "$FROM" --next-token --current-token --features $STAGE2/features --dtype bf16 \
  --threads 2 --precision bf16 --lr 3e-4 --kind edd --epochs "$EPOCHS" --out $WORK/edd --resume
