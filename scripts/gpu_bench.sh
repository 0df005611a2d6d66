#!/usr/bin/env bash
# spectot on a CUDA GPU, in stages that fit short leases:
#   tests  — the engine, spec, scheduler, search and training tests with the tiny models on the GPU
#            (SPECTOT_TEST_DEVICE=cuda); fp32 losslessness there is token-for-token, as on the CPU
#   ops    — scripts/runner_ops.py on the GPU: aten ops and time of one forward (bf16)
#   kernels — spectot's CPU kernel tests in one process (an H200 host's CPU crashed them under xdist once)
#   exact  — `spectot bench drafts --dtype fp32` on 2 GSM8K prompts: every draft's tokens must be ar's
#            (EXACT_DTYPE=bf16 KERNELS=tiled: the same check for bf16 on fixed row tiles)
#   drafts — `spectot bench drafts` on SmolLM2 (bf16): ar, n-gram, EDD, EDD + lookup, EDD + PCT (+ VDM with
#            DRAFT_ROWS naming it; VDM=FOLDER where the shipped weights did not travel)
#   spex   — `spectot bench spex` on GSM8K: REBASE plain / sd, rStar plain / spex+sd (EDD drafts)
# Needs python3 with torch (CUDA) and spectot's dependencies importable; run from the repository root.
# Usage: scripts/gpu_bench.sh STAGE[,STAGE...] [OUT=runs/gpu] [DATA=../shared/data] [PROBLEMS=8]
# Knobs (environment): STAGE_SECONDS / TEST_SECONDS (each stage's timeout), WORKERS (pytest -n), TESTS,
# KERNELS (--kernels of exact and drafts), EXACT_DTYPE, DRAFT_ROWS / EXACT_ROWS (bench drafts --methods),
# GSM8K_PROMPTS / CW_PROMPTS (the drafts stage's prompts), IN_FLIGHT, DRAFT_WIDTH and SPEX_FLAGS (more bench spex
# flags, e.g. "--tree pct" or "--tree sequoia --acceptance src/spectot/models/drafts/smollm2-135m-edd/acceptance.json
# --tree-budget 32")
set -u
stages=${1:?usage: scripts/gpu_bench.sh tests,ops,kernels,exact,drafts,spex [OUT] [DATA] [PROBLEMS]}
out=${2:-runs/gpu}
data=${3:-../shared/data}
problems=${4:-8}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name(), torch.__version__)" || exit 1

for stage in ${stages//,/ }; do
  case $stage in
  tests)
    SPECTOT_TEST_DEVICE=cuda timeout "${TEST_SECONDS:-240}" "$py" -m pytest -q -p no:cacheprovider -n "${WORKERS:-8}" \
      ${TESTS:-tests/spec tests/engine tests/schedulers tests/models tests/train tests/search tests/explore
      tests/test_solve.py tests/bench/test_drafts_bench.py} --tb=line \
      --ignore=tests/engine/test_kernels.py --ignore=tests/engine/test_decoder_ops.py --ignore=tests/engine/test_openmp.py \
      >"$out/tests.log" 2>&1  # (the ignored files test spectot's CPU kernels)
    echo "tests: exit $?"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | cut -c1-160 | head -25
    grep -E "^E |Error: " "$out/tests.log" | cut -c1-160 | sort | uniq -c | sort -rn | head -15; tail -1 "$out/tests.log"
    ;;
  ops)
    timeout "${STAGE_SECONDS:-600}" "$py" scripts/runner_ops.py --device cuda --dtype bf16 2>&1 | grep -E "aten ops|Error"
    ;;
  kernels)
    timeout "${TEST_SECONDS:-240}" "$py" -X faulthandler -m pytest -q -p no:cacheprovider -p no:xdist \
      tests/engine/test_kernels.py tests/engine/test_decoder_ops.py --tb=line >"$out/kernels.log" 2>&1
    echo "kernels: exit $?"; grep -E "^(FAILED|ERROR)|Fatal|File .*test_" "$out/kernels.log" | head -20; tail -1 "$out/kernels.log"
    ;;
  exact)
    timeout "${STAGE_SECONDS:-600}" "$py" -m spectot bench drafts --device cuda --dtype "${EXACT_DTYPE:-fp32}" \
      --kernels "${KERNELS:-auto}" --gsm8k "$data/gsm8k/test.jsonl" \
      --gsm8k-prompts 2 --cw-prompts 0 --max-new-tokens 64 --methods "${EXACT_ROWS:-ngram,edd,edd+pct+lookup}" \
      --out "$out/exact_${EXACT_DTYPE:-fp32}_${KERNELS:-auto}" >"$out/exact.log" 2>&1
    echo "exact: exit $?"; tail -2 "$out/exact.log"
    "$py" - "$out/exact_${EXACT_DTYPE:-fp32}_${KERNELS:-auto}/records.jsonl" <<'PY'
import json, sys
tokens = {tuple(r["key"]): r["value"]["tokens"] for r in map(json.loads, open(sys.argv[1])) if r["key"][0] != "cost"}
same = {k: v == tokens[("ar", k[1])] for k, v in tokens.items() if k[0] != "ar"}
print(f"on the GPU: {sum(same.values())} of {len(same)} draft runs equal ar token for token;", "differ:", [k for k, v in same.items() if not v])
PY
    ;;
  drafts)
    timeout "${STAGE_SECONDS:-600}" "$py" -m spectot bench drafts --device cuda --kernels "${KERNELS:-auto}" \
      --gsm8k "$data/gsm8k/test.jsonl" \
      --creative-writing "$data/tot_creative_writing/data_100_random_text.txt" --gsm8k-prompts "${GSM8K_PROMPTS:-8}" --cw-prompts "${CW_PROMPTS:-4}" \
      --vdm "${VDM:-vdm}" --methods "${DRAFT_ROWS:-ngram,edd,edd+pct,edd+lookup,edd+pct+lookup}" \
      --out "$out/drafts" >"$out/drafts.log" 2>&1
    echo "drafts: exit $?"; tail -3 "$out/drafts.log"; cat "$out/drafts/results.md" 2>/dev/null | head -30
    ;;
  spex)
    common=(--device cuda --draft edd --gsm8k "$data/gsm8k/test.jsonl" --math500 "" --problems "$problems"
      --in-flight "${IN_FLIGHT:-1}" --budget 4 --no-remote --fixed-k-total 8 --draft-width "${DRAFT_WIDTH:-0}"
      ${SPEX_FLAGS:-})
    timeout "${STAGE_SECONDS:-600}" "$py" -m spectot bench spex "${common[@]}" --searches rebase --variants plain,sd --out "$out/spex_rebase" \
      >"$out/spex_rebase.log" 2>&1
    echo "spex rebase: exit $?"; tail -3 "$out/spex_rebase.log"; cat "$out/spex_rebase/results.md" 2>/dev/null | head -20
    timeout "${STAGE_SECONDS:-600}" "$py" -m spectot bench spex "${common[@]}" --searches rstar --variants plain,spex+sd --out "$out/spex_rstar" \
      >"$out/spex_rstar.log" 2>&1
    echo "spex rstar: exit $?"; tail -3 "$out/spex_rstar.log"; cat "$out/spex_rstar/results.md" 2>/dev/null | head -20
    ;;
  *) echo "unknown stage '$stage' (tests, ops, kernels, exact, drafts, spex)"; exit 2 ;;
  esac
done
