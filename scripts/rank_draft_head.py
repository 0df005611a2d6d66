"""Rank a trained draft's head by how often the target writes each token, so `--draft-head N` can cut it.

Drafts trained before session 28 store their 8,192 head ids in id order. The ids' frequencies come from
the target's own generations (`spectot generate --method ar --out FILE`, the `token_ids` of each line):
the tokens a draft must propose are the ones the target writes. The head keeps the same set of ids, only
in the new order (EOS ids first, then most frequent first), so the draft with its whole head is the same
function as before; `draft.json` gets `head_ranked: true`.

Usage: python scripts/rank_draft_head.py --draft src/spectot/models/drafts/smollm2-135m-edd \
           --target smollm2-135m --generations runs/rank/gsm_gen.jsonl runs/rank/cw_gen.jsonl [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from spectot.data.jsonl import iter_jsonl
from spectot.models.draft_decoder import rank_head
from spectot.models.loader import load_model


def token_counts(files: list[Path], vocab: int) -> tuple[torch.Tensor, int]:
    counts, n = torch.zeros(vocab, dtype=torch.int64), 0
    for path in files:
        for _, row in iter_jsonl(path):
            ids = torch.tensor(row["token_ids"], dtype=torch.int64)
            counts += torch.bincount(ids, minlength=vocab)
            n += ids.numel()
    return counts, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", type=Path, required=True, help="a draft folder (draft.json + draft.safetensors)")
    parser.add_argument("--target", default="smollm2-135m", help="the draft's target (for its EOS ids)")
    parser.add_argument("--generations", type=Path, nargs="+", required=True, help="`spectot generate --out` files")
    parser.add_argument("--out", type=Path, default=None, help="write here (default: rewrite --draft in place)")
    args = parser.parse_args()

    config = json.loads((args.draft / "draft.json").read_text())
    state = load_file(str(args.draft / "draft.safetensors"))
    target = load_model(args.target)
    vocab = int(target.model.config.vocab_size)
    counts, n = token_counts(args.generations, vocab)
    head = state["head_ids"].to(torch.int64)
    ranked = rank_head(head, counts, target.eos_token_ids)
    if sorted(ranked.tolist()) != sorted(head.tolist()):
        raise RuntimeError("ranking changed the head's set of ids")
    state["head_ids"] = ranked.to(torch.int32).contiguous()
    config["head_ranked"] = True
    out = args.out or args.draft
    out.mkdir(parents=True, exist_ok=True)
    if out != args.draft:
        for extra in args.draft.iterdir():
            if extra.name not in ("draft.json", "draft.safetensors"):
                shutil.copy2(extra, out / extra.name)
    save_file(state, str(out / "draft.safetensors"))
    (out / "draft.json").write_text(json.dumps(config, indent=1))
    covered = [int(counts[ranked[:size]].sum()) / max(n, 1) for size in (1024, 2048, 4096, head.numel())]
    print(f"{n} generated tokens; share the head's first 1024 / 2048 / 4096 / all ids cover: {covered}")


if __name__ == "__main__":
    main()
