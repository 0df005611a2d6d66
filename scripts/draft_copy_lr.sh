#!/bin/bash
# Stage 5 of the EDD for smollm2-135m: the shipped EDD (FROM=edd) given both token inputs (--current-token,
# --next-token: each hidden entry holds x_i and x_{i+1}, the key and value of a copy) and, unlike
# scripts/draft_copy.sh (session 25), their own learning rate (--token-lr): from 0, at the base lr Adam moved
# them too little in an epoch for the layer to learn a copy. New text of the target's own, greedy (what the
# benchmark decodes): the 60 training Creative Writing inputs and RECOMBINED more made of their sentences (4
# drawn at random each, seeded; inputs 61+ stay held out), where the target restates the sentences it was given,
# and answers to GSM8K train questions 6,421-7,220 so the GSM8K behaviour is kept. Run from the repository root
# with `.venv` built and ../shared/data beside the repo; writes runs/draft_copy_lr/edd; every stage resumes.
# STAGE=s > 1 then adds, for each stage 2..s, MORE_s recombined inputs drawn with seed s - 1 (their own file) and
# trains the previous stage's draft on over all files so far: runs/draft_copy_lr/edd{s} (session 30: stage 2 with
# 600 more, stage 3 with 1,200 more).
set -euo pipefail
. .venv/bin/activate
DATA=../shared/data
WORK=runs/draft_copy_lr
FROM=${FROM:-edd}
RECOMBINED=${RECOMBINED:-300}
STAGE=${STAGE:-1}
MORE=(0 0 600 1200)  # recombined inputs added at stage 2, 3
EPOCHS=${EPOCHS:-2}
TOKEN_LR=${TOKEN_LR:-3e-3}
mkdir -p $WORK

python - "$DATA" "$WORK" "$RECOMBINED" "${MORE[@]:2}" <<'PY'
import json, random, re, sys
data, work, n, more = sys.argv[1], sys.argv[2], int(sys.argv[3]), [int(m) for m in sys.argv[4:]]
from spectot.tasks.creative_writing import cot_prompt, read_inputs
inputs = read_inputs(f"{data}/tot_creative_writing/data_100_random_text.txt", 0, 60)
pool = [s for line in inputs for s in re.split(r'(?<=[.!?"\u201d])\s+(?=[A-Z"\u201c])', line.strip()) if s]
def recombined(count, seed):
    rng = random.Random(seed)
    return [cot_prompt(" ".join(rng.sample(pool, 4))) for _ in range(count)]
qs = [json.loads(l)["question"] for l in open(f"{data}/gsm8k/train.jsonl")]
files = {"cw": [cot_prompt(s) for s in inputs] + recombined(n, 0), "gsm": qs[6420:7220]}
for stage, count in enumerate(more, start=2):
    files[f"cw_s{stage}"] = recombined(count, stage - 1)
for name, prompts in files.items():
    with open(f"{work}/prompts_{name}.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps({"question": p}) + "\n")
PY

gen() {  # --out appends each finished batch; a rerun resumes after the last one written
  spectot generate --method ar --draft none --threads 2 --out "$@"
}
gen $WORK/self_cw.jsonl --prompts $WORK/prompts_cw.jsonl --batch-size 60 --max-new-tokens 384
gen $WORK/self_gsm.jsonl --prompts $WORK/prompts_gsm.jsonl --batch-size 64 --max-new-tokens 256
for stage in $(seq 2 "$STAGE"); do
  gen $WORK/self_cw_s$stage.jsonl --prompts $WORK/prompts_cw_s$stage.jsonl --batch-size 60 --max-new-tokens 384
done
[ "${CORPUS_ONLY:-0}" = 1 ] && exit 0

if [ "$STAGE" -gt 1 ]; then
  CORPUS="--corpus $WORK/self_cw.jsonl"
  for stage in $(seq 2 "$STAGE"); do CORPUS="$CORPUS --corpus $WORK/self_cw_s$stage.jsonl"; done
  PREVIOUS=$WORK/edd$([ "$STAGE" -gt 2 ] && echo $((STAGE - 1)) || true)
  spectot train-draft $CORPUS --corpus $WORK/self_gsm.jsonl --init "$PREVIOUS" --next-token --current-token \
    --features $WORK/features --dtype bf16 --threads 2 --precision bf16 --lr 3e-4 --token-lr "$TOKEN_LR" \
    --kind edd --epochs "$EPOCHS" --out $WORK/edd$STAGE --resume
  exit 0
fi
spectot train-draft --corpus $WORK/self_cw.jsonl --corpus $WORK/self_gsm.jsonl --init "$FROM" --next-token \
  --current-token --features $WORK/features --dtype bf16 --threads 2 --precision bf16 --lr 3e-4 \
  --token-lr "$TOKEN_LR" --kind edd --epochs "$EPOCHS" --out $WORK/edd --resume
