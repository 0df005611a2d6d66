#!/bin/bash
# Stage 2 of the shipped EDD for smollm2-135m: fine-tunes the stage-1 draft (scripts/draft_recipe.sh's output,
# or the shipped one: FROM=edd) on fresh text of the target's own, then writes src/.../smollm2-135m-edd's files
# to runs/draft_finetune/edd. Run from the repository root with `.venv` built and ../shared/data beside the repo.
# New text, disjoint from stage 1's prompts: greedy answers to GSM8K train questions 3,629-5,628, one sampled
# (T = 1) ToT path for train questions 5,629-6,028, plus stage 1's Creative Writing inputs 1-60 again (greedy and
# one new T = 1 sample) so the stories are not forgotten. Every stage resumes where it stopped (rerun the script).
set -euo pipefail
. .venv/bin/activate
DATA=../shared/data
WORK=runs/draft_finetune
FROM=${FROM:-edd}
mkdir -p $WORK

python - "$DATA" "$WORK" <<'PY'
import json, sys
data, work = sys.argv[1:]
from spectot.tasks.creative_writing import cot_prompt, read_inputs
qs = [json.loads(l)["question"] for l in open(f"{data}/gsm8k/train.jsonl")]
cw = [cot_prompt(s) for s in read_inputs(f"{data}/tot_creative_writing/data_100_random_text.txt", 0, 60)]
for name, prompts in (("gsm3", qs[3628:5628]), ("cw", cw)):
    with open(f"{work}/prompts_{name}.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps({"question": p}) + "\n")
PY

gen() {  # --out appends each finished batch; a rerun resumes after the last one written
  spectot generate --method ar --draft none --out "$@"
}
gen $WORK/self_gsm3.jsonl --prompts $WORK/prompts_gsm3.jsonl --batch-size 64 --max-new-tokens 256
python scripts/tot_corpus.py --data $DATA/gsm8k/train.jsonl --offset 5628 --limit 400 --out $WORK/tot_gsm2
gen $WORK/self_cw.jsonl --prompts $WORK/prompts_cw.jsonl --batch-size 30 --max-new-tokens 384
gen $WORK/self_cw_t1_s4.jsonl --prompts $WORK/prompts_cw.jsonl --batch-size 60 --max-new-tokens 384 \
  --temperature 1 --seed 4
[ "${CORPUS_ONLY:-0}" = 1 ] && exit 0

CORPUS=""
for f in self_gsm3 tot_gsm2.step1 tot_gsm2.step2 tot_gsm2.step3 tot_gsm2.step4 self_cw self_cw_t1_s4; do
  if [ -f $WORK/$f.jsonl ]; then CORPUS="$CORPUS --corpus $WORK/$f.jsonl"; fi
done
spectot train-draft $CORPUS --init $FROM --features $WORK/features --dtype bf16 --threads 2 --precision bf16 \
  --lr 3e-4 --kind edd --epochs 3 --out $WORK/edd --resume

scripts/draft_acceptance.sh $WORK/edd
