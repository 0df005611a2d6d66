"""How often a one-token draft survives sampled verification, three ways, on the target's own sampled text.

spectot verifies a deterministic draft against the target's own coupled sample (``spec/verify.py``): the
draft token x survives with probability p(x). A draft that proposes its argmax (`--no-coupled`) survives
with p(argmax q). Drawing the draft token with the *same* noise (the default since session 22) as the target's sample (an exponential race,
x = argmax_i p_i / E_i with E_i ~ Exp(1) shared) keeps the output the target's own sample, token for token,
and survives with P(argmax p/E == argmax q/E), which tends to 1 as q tends to p (Daliri et al., "Coupling
without communication and drafter-invariant speculative decoding", 2024). The standard rule's 1 - TV(p, q)
is shown for scale; it does not reproduce a seed's sample.

Samples GSM8K Thought Generator steps from the target at each setting (the search's own prompts), then, for each generated
position, computes the EDD's first-token distribution q (block length 1 of the dual-block mask: the hidden
states of every earlier token, the token's own embedding) and p, both under that setting.

Usage: python scripts/coupling_probe.py [--problems 8] [--tokens 96] [--noise 256] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch

from spectot.engine.runner import StreamTree
from spectot.engine.token_tree import TokenTree
from spectot.pipeline import Pipeline
from spectot.spec.sampling import SamplingParams, target_probs
from spectot.tasks.registry import load_problems, make_task

SETTINGS = {"T=1": SamplingParams(True, 1.0), "T=0.8,p=0.95": SamplingParams(True, 0.8, top_p=0.95)}
SETTINGS["T=0.6"] = SamplingParams(True, 0.6)


def survival(p: torch.Tensor, q_full: torch.Tensor, noise: int, generator: torch.Generator) -> dict[str, float]:
    """p, q_full: (T, V) probabilities (q zero outside the draft's head). Means over positions."""
    det = p.gather(1, q_full.argmax(1, keepdim=True))[:, 0]  # p(argmax q)
    tv = 0.5 * (p - q_full).abs().sum(1)
    hits = torch.zeros(p.shape[0])
    for _ in range(noise):
        e = torch.empty_like(p).exponential_(generator=generator)
        hits += ((p / e).argmax(1) == (q_full / e).argmax(1)).float()
    return {"argmax": float(det.mean()), "coupled": float((hits / noise).mean()), "one_minus_tv": float(1 - tv.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/gsm8k/test.jsonl")
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--noise", type=int, default=256)
    parser.add_argument("--dtype", default="fp32", choices=["bf16", "fp32"])
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    pipe = Pipeline.load("smollm2-135m", dtype=args.dtype, draft="edd", adaptive_k=False)
    draft = pipe.proposer.draft
    head = draft.head_ids.cpu()
    task = make_task("gsm8k")
    problems = load_problems("gsm8k", args.data, args.problems, 100)  # disjoint from bench spex's first 40
    prompts = [task.thought(p, ()).prompt for p in problems]
    generator = torch.Generator().manual_seed(0)
    totals: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for (name, params), (i, prompt) in itertools.product(SETTINGS.items(), enumerate(prompts)):
        sampled = dict(do_sample=True, temperature=params.temperature, top_p=params.top_p)
        out = pipe.generate(prompt, max_new_tokens=args.tokens, method="ar", seed=i, **sampled)[0]
        ids = list(out.prompt_ids) + list(out.token_ids)
        runner = pipe.runner
        stream = runner.new_stream()
        try:
            result = runner.forward([StreamTree(stream, TokenTree.chain(ids))], hidden_layer=draft.config.hidden_layer)
            runner.commit({})
        finally:
            runner.release(stream)
        first = len(out.prompt_ids) - 1  # row t predicts token t + 1: rows of the generated tokens' predictions
        logits_p = result.logits[0][first:-1]  # (n, V)
        tokens = torch.tensor(ids)[None]
        with torch.inference_mode():
            q_logits = draft(tokens, result.hidden[0][None], torch.arange(len(ids)))[0, first:-1].float().cpu()
        p = target_probs(logits_p, params)
        q_full = torch.zeros_like(p)
        q_full[:, head] = target_probs(q_logits, params)
        totals[name].append(survival(p, q_full, args.noise, generator) | {"positions": p.shape[0]})
    summary = {}
    for name, rows in totals.items():
        weight = [r["positions"] for r in rows]
        summary[name] = {
            key: sum(r[key] * w for r, w in zip(rows, weight)) / sum(weight)
            for key in ("argmax", "coupled", "one_minus_tv")
        }
        summary[name]["per_prompt_coupled_minus_argmax"] = [round(r["coupled"] - r["argmax"], 3) for r in rows]
        summary[name]["median_gain"] = statistics.median(summary[name]["per_prompt_coupled_minus_argmax"])
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
