"""Teacher-forced first-token agreement of trained drafts with the target, on `bench drafts` prompts.

For each prompt, the target's own greedy continuation (the `ar` rows of a `bench drafts` records file) is
run through the target once (fp32); each draft then predicts every generated token as the first of its
block, from the target's hidden states before it. The share of positions where the draft's argmax is the
target's is what a chain's first draft token gets accepted at. Prompt 27 of the 20 GSM8K + 8 Creative
Writing set is the passage where the target restates its four given sentences (Creative Writing input 68).

    python scripts/draft_agreement.py --records docs/results/bench_drafts_zen5_s24_next/records.jsonl \
        --prompts 3,22,27 edd runs/draft_next/edd runs/draft_copy/edd
"""

import argparse
import json

import torch

from spectot.config import DraftOptions, ModelOptions
from spectot.data.jsonl import read_field
from spectot.models.draft_decoder import DraftDecoder
from spectot.pipeline import Pipeline, draft_decoder_folder
from spectot.tasks.creative_writing import cot_prompt, read_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafts", nargs="+", help="draft aliases (edd, vdm) or folders")
    parser.add_argument("--records", required=True, help="a bench drafts records.jsonl with ar rows")
    parser.add_argument("--prompts", default="3,22,27", help="prompt indices of that run")
    parser.add_argument("--gsm8k", default="../shared/data/gsm8k/test.jsonl")
    parser.add_argument("--creative-writing", default="../shared/data/tot_creative_writing/data_100_random_text.txt")
    args = parser.parse_args()
    ar = {r["key"][1]: r["value"]["tokens"] for r in map(json.loads, open(args.records)) if r["key"][0] == "ar"}
    run = json.load(open(args.records.replace("records.jsonl", "results.json")))["config"]  # the run's prompts
    skip, count = run["gsm8k_offset"], run["gsm8k_prompts"]
    texts = read_field(args.gsm8k, "question", skip + count)[skip:] + [
        cot_prompt(s) for s in read_inputs(args.creative_writing, run["cw_offset"], run["cw_prompts"])
    ]
    pipe = Pipeline.from_options(ModelOptions(dtype="fp32"), DraftOptions(draft="none"))
    model = pipe.target.model
    for name in args.drafts:
        draft = DraftDecoder.load(draft_decoder_folder(name, "smollm2-135m") or name, model)
        for i in map(int, args.prompts.split(",")):
            prompt = pipe.encode(texts[i])
            ids = torch.tensor(prompt + ar[i])
            with torch.no_grad():
                out = model(ids[None], output_hidden_states=True)
                target = out.logits[0].argmax(-1)
                # every position starts its own block: each generated token is a chain's first draft token
                logits = draft(ids[None], out.hidden_states[draft.config.hidden_layer], torch.arange(ids.numel()))[0]
                guess = draft.head_ids[logits.argmax(-1)]
            n = len(prompt)
            agreement = (guess[n - 1 : -1] == target[n - 1 : -1]).float().mean().item()
            print(f"{name}\tprompt {i}\tfirst-token agreement {agreement:.2f}")


if __name__ == "__main__":
    main()
