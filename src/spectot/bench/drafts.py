"""`spectot bench drafts`: n-gram, VDM, EDD and EDD + PCT drafts, alone and with the prompt-lookup
branch (``--lookup``), on the same held-out prompts.

One run, greedy, SmolLM2 (or any target with trained drafts): held-out GSM8K test questions and
Creative Writing inputs after the training lines. For every draft: tokens per step (including the
bonus token), acceptance rate, the draft cost c (a draft depth step relative to a target step, measured
in this run), tokens/s, speedup over ``ar`` and the EDD paper's calibration error (ECE), with its
reliability diagram (the paper's figure 3b: acceptance against draft confidence, calibration.png). Extra drafts
(the ablations: no hidden states, cross-entropy loss, fixed block length, another hidden layer) are
given as NAME=FOLDER. Records are appended as they finish, so an interrupted run resumes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, fields, replace
from typing import Any
from pathlib import Path

import torch

from spectot.bench.progress import progress_bar, pyplot
from spectot.bench.records import append_record, load_records, machine_info, run_identity
from spectot.bench.trees import profile_costs
from spectot.config import BenchDraftsOptions, DraftOptions, ModelOptions
from spectot.pipeline import Pipeline, make_proposer, size_pct_trees
from spectot.spec.profile import T_CURVE_ROWS, measure_costs
from spectot.spec.proposers.base import Proposer
from spectot.spec.decoding import DecodeConfig
from spectot.spec.stats import DecodeStats

logger = logging.getLogger(__name__)


def run_bench_drafts(model_opts: ModelOptions, opts: BenchDraftsOptions) -> dict:
    from spectot.data.jsonl import read_field
    from spectot.tasks.creative_writing import cot_prompt, read_inputs

    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if model_opts.threads:
        torch.set_num_threads(model_opts.threads)
    wanted = opts.gsm8k_offset + opts.gsm8k_prompts  # the data is read before the model loads: a bad line costs seconds
    questions = (
        read_field(opts.gsm8k, "question", wanted, complete=True)[opts.gsm8k_offset :] if opts.gsm8k_prompts else []
    )
    inputs = (
        read_inputs(opts.creative_writing, opts.cw_offset, opts.cw_prompts, complete=True) if opts.cw_prompts else []
    )
    pipe = Pipeline.from_options(model_opts, DraftOptions(draft="none"))
    texts = questions + [cot_prompt(s) for s in inputs]
    prompts = [pipe.encode(t) for t in texts]
    methods = _methods(opts)
    config_key = run_identity({**asdict(opts), **asdict(model_opts)})
    records = load_records(out / "records.jsonl", config_key)
    # prompt-major order: a machine whose speed drifts during the run (shared memory bandwidth) slows
    # every draft alike, where method-major order would hand the drift to whichever draft ran then
    todo = [(name, i) for i in range(len(prompts)) for name in methods if (name, i) not in records]
    with progress_bar() as bar:
        task = bar.add_task("bench drafts", total=len(todo) + len(methods) + 1)
        if ("cost", "t_curve") not in records:  # PCT sizes its trees by it; reported with the results
            t_curve = measure_costs(pipe.runner, None, ns=T_CURVE_ROWS, prefix=64, reps=5)
            append_record(out / "records.jsonl", config_key, ("cost", "t_curve"), t_curve, records)
        bar.advance(task)
        for name, options in methods.items():
            if options is not None and options.draft != "ngram" and ("cost", name) not in records:
                pipe.decoder.proposer = make_proposer(replace(options, tree="chain"), pipe.target, model_opts)
                costs = profile_costs(pipe, n_max=1)
                append_record(
                    out / "records.jsonl",
                    config_key,
                    ("cost", name),
                    {k: v for k, v in costs.items() if k != "t_curve"},
                    records,
                )
            bar.advance(task)
        proposers: dict[str, Proposer | None] = {}
        for name, i in todo:
            options = methods[name]
            config = DecodeConfig(
                max_new_tokens=opts.max_new_tokens,
                method="ar" if options is None else "sd",
                num_draft_tokens=options.num_draft_tokens if options else 1,
            )
            first_use = name not in proposers
            if first_use:
                proposers[name] = None if options is None else make_proposer(options, pipe.target, model_opts)
                if options is not None and options.tree == "pct":
                    size_pct_trees(proposers[name], records[("cost", "t_curve")])
            pipe.decoder.proposer = proposers[name]
            if first_use:
                pipe.decoder.generate([prompts[0][:24]], replace(config, max_new_tokens=8))  # untimed warm-up
            pipe.decoder.clear_prefix_caches()  # every draft prefills the prompt, a trained one too: fair times
            res = pipe.decoder.generate([prompts[i]], config)[0]
            append_record(
                out / "records.jsonl",
                config_key,
                (name, i),
                {"tokens": res.token_ids, "stats": res.stats.to_dict()},
                records,
            )
            bar.advance(task)
    result = {
        "rows": _summarize(records, methods, len(prompts), len(questions)),
        "t_curve": records.get(("cost", "t_curve"), {}).get("t_curve", []),
        "config": config_key,
        "machine": machine_info(),
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(_markdown(result))
    _plot_calibration(result["rows"], out / "calibration.png")
    return result


def _methods(opts: BenchDraftsOptions) -> dict[str, DraftOptions | None]:
    methods: dict[str, DraftOptions | None] = {
        "ar": None,
        "ngram": DraftOptions(draft="ngram", num_draft_tokens=opts.k),
        "vdm": DraftOptions(draft=opts.vdm, num_draft_tokens=opts.k, lookup=0),
        "edd": DraftOptions(draft=opts.edd, num_draft_tokens=opts.k, lookup=0),
        "edd+pct": DraftOptions(
            draft=opts.edd, tree="pct", pct_threshold=opts.pct_threshold, num_draft_tokens=16, lookup=0
        ),
    }
    if opts.lookup:
        methods["edd+lookup"] = replace(methods["edd"], lookup=opts.lookup)
        methods["edd+pct+lookup"] = replace(methods["edd+pct"], lookup=opts.lookup)
    ablations = []
    for item in opts.ablation:
        name, _, spec = item.partition("=")
        if not spec:
            raise ValueError(f"--ablation expects NAME=DRAFT[,FIELD=VALUE...], got '{item}'")
        methods[name] = _ablation_row(spec, opts.k)
        ablations.append(name)
    if not opts.methods:
        return methods
    wanted = {"ar", *opts.methods.split(","), *ablations}  # an --ablation row is asked for by naming it
    unknown = wanted - set(methods)
    if unknown:
        raise ValueError(f"--methods: unknown rows {sorted(unknown)}; this run has {', '.join(methods)}")
    return {name: draft for name, draft in methods.items() if name in wanted}


def _ablation_row(spec: str, k: int) -> DraftOptions:
    """DRAFT[,FIELD=VALUE...] -> the row's draft options: a k-token chain without lookup, then the FIELDs.

    Example: "edd,tree=pct,draft_head=2048" -> DraftOptions(draft="edd", tree="pct", draft_head=2048, ...)."""
    folder, *pairs = spec.split(",")
    known = {f.name: f for f in fields(DraftOptions)}
    values: dict[str, Any] = {"draft": folder, "num_draft_tokens": k, "lookup": 0}
    for pair in pairs:
        key, _, text = pair.partition("=")
        if key not in known or key == "draft" or not text:
            raise ValueError(f"--ablation: '{pair}' is not FIELD=VALUE of a draft option ({', '.join(known)})")
        kind = type(known[key].default)
        values[key] = text.lower() in ("1", "true", "yes") if kind is bool else kind(text)
    return DraftOptions(**values)


def _summarize(records: dict, methods: dict, n_prompts: int, n_gsm8k: int) -> list[dict]:
    rows = []
    for subset, idx in (
        ("all", range(n_prompts)),
        ("gsm8k", range(n_gsm8k)),
        ("creative_writing", range(n_gsm8k, n_prompts)),
    ):
        ar_speed = None
        # the prompts every method has a record of: a run cut short compares the methods on the same prompts
        idx = [i for i in idx if all((name, i) in records for name in methods)]
        for name in methods:
            recs = [records[(name, i)] for i in idx]
            if not recs:
                continue
            stats = [r["stats"] for r in recs]
            steps = sum(s["verify_steps"] for s in stats)
            accepted = sum(s["accepted"] for s in stats)
            proposed = sum(s["proposed"] for s in stats)
            n = [sum(s["calibration_n"][b] for s in stats) for b in range(len(stats[0]["calibration_n"]))]
            acc = [sum(s["calibration_accepted"][b] for s in stats) for b in range(len(n))]
            conf = [sum(s["calibration_confidence"][b] for s in stats) for b in range(len(n))]
            speed = sum(s["new_tokens"] for s in stats) / sum(s["time_total"] for s in stats)
            ar_speed = speed if name == "ar" else ar_speed
            forwards = sum(s["target_forwards"] for s in stats)
            split = {part: sum(s[f"time_{part}"] for s in stats) for part in ("total", "draft", "verify")}
            cost = records.get(("cost", name), {})
            rows.append(
                {
                    "method": name,
                    "prompts": subset,
                    "prompts_compared": len(idx),
                    "tokens_per_step": (accepted + steps) / steps if steps else 1.0,
                    "acceptance_rate": accepted / proposed if proposed else 0.0,
                    "c": cost.get("c_extra_depth"),
                    "tokens_per_second": speed,
                    "speedup_vs_ar": speed / ar_speed if ar_speed else None,
                    # where a target forward's time goes (ms): drafting, verifying (the forward and the
                    # acceptance rule), the rest (prefill included)
                    "ms_per_step": {
                        "draft": 1e3 * split["draft"] / forwards,
                        "verify": 1e3 * split["verify"] / forwards,
                        "other": 1e3 * (split["total"] - split["draft"] - split["verify"]) / forwards,
                    },
                    "calibration_error": DecodeStats(
                        calibration_n=n, calibration_accepted=acc, calibration_confidence=conf
                    ).calibration_error
                    if sum(n)
                    else None,
                    "calibration": [
                        {"confidence": c / k, "accepted": a / k, "count": k} for a, c, k in zip(acc, conf, n) if k
                    ],
                }
            )
    return rows


def _markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"# bench drafts — {cfg['target']} {cfg['dtype']}, {cfg['gsm8k_prompts']} held-out GSM8K + {cfg['cw_prompts']} "
        f"Creative Writing prompts, {cfg['max_new_tokens']} new tokens, greedy, k = {cfg['k']}, {result['machine']['threads']} threads",
        "",
        "| prompts | draft | tokens/step (incl. bonus) | acceptance rate | c (its chain's depth step / target step) | tokens/s | "
        "speedup vs ar | ms per step: draft / verify / other | ECE |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        c = "–" if r["c"] is None else f"{r['c']:.3f}"
        ece = "–" if r["calibration_error"] is None else f"{r['calibration_error']:.3f}"
        ms = r["ms_per_step"]
        lines.append(
            f"| {r['prompts']} | {r['method']} | {r['tokens_per_step']:.2f} | {r['acceptance_rate']:.2f} | {c} | "
            f"{r['tokens_per_second']:.1f} | {r['speedup_vs_ar']:.2f}x | "
            f"{ms['draft']:.1f} / {ms['verify']:.1f} / {ms['other']:.1f} | {ece} |"
        )
    compared = {r["prompts"]: r.get("prompts_compared") for r in result["rows"]}
    lines += [
        "",
        "Every draft compared on the same prompts ("
        + ", ".join(f"{k}: {v}" for k, v in compared.items() if v is not None)
        + "). c is each draft's chain timed on its own, once a row (a row's tree or lookup branch is not in it: the "
        "spread of c between rows of one draft is the timing's noise).",
    ]
    if result.get("t_curve"):
        points = ", ".join(f"t({p['n']}) = {p['t']:.2f}" for p in result["t_curve"])
        lines += ["", f"Target forward over n rows, relative to one (PCT sizes its trees by it): {points}"]
    return "\n".join(lines) + "\n"


def _plot_calibration(rows: list[dict], path: Path) -> None:
    """Acceptance rate against draft confidence per bin, one line per trained draft, over all prompts."""
    plt = pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.plot([0, 1], [0, 1], color="#999", linestyle="--", linewidth=1, label="calibrated")
    for r in rows:
        if r["prompts"] == "all" and r["calibration"]:
            bins = r["calibration"]
            label = f"{r['method']} (ECE {r['calibration_error']:.3f})"
            ax.plot([b["confidence"] for b in bins], [b["accepted"] for b in bins], marker="o", label=label)
    ax.set_xlabel("draft confidence (mean of the bin)")
    ax.set_ylabel("accepted by the target (fraction)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title("draft calibration (EDD paper, fig. 3b)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
