#!/bin/bash
# Stage 3 of the shipped EDD for smollm2-135m: the stage-2 draft (the shipped one, FROM=edd) given the
# next-token input (`train-draft --next-token`: hidden entry i also reads e(x_{i+1}), at zero weight to start)
# and fine-tuned on stage 2's corpus, so one layer can copy what the target restates. Run from the repository
# root after scripts/draft_finetune.sh wrote runs/draft_finetune (its corpus and features are reused: no new
# target pass). Writes runs/draft_next/edd; resumes where it stopped (rerun the script).
set -euo pipefail
. .venv/bin/activate
STAGE2=runs/draft_finetune
WORK=runs/draft_next
FROM=${FROM:-edd}
EPOCHS=${EPOCHS:-2}
mkdir -p $WORK
CORPUS=""
for f in self_gsm3 tot_gsm2.step1 tot_gsm2.step2 tot_gsm2.step3 tot_gsm2.step4 self_cw self_cw_t1_s4; do
  CORPUS="$CORPUS --corpus $STAGE2/$f.jsonl"
done
spectot train-draft $CORPUS --init $FROM --next-token --features $STAGE2/features --dtype bf16 --threads 2 \
  --precision bf16 --lr 3e-4 --kind edd --epochs $EPOCHS --out $WORK/edd --resume
