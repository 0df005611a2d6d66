"""Token-tree measurements and `spectot bench trees`.

- ``measure_acceptance``: Sequoia's positional acceptance vector, measured by decoding real prompts
  with a star tree (the draft's W best candidates below the pending token) and counting which
  rank the verifier accepts (``DecodeStats.accepted_rank``).
- ``profile_costs``: the target's t(n) curve and the draft step cost c relative to a target step,
  on this machine, for the hardware-aware tree size (``spec/trees/sizing.py``).
- ``run_bench_trees``: every tree method on the same prompts (GSM8K test questions and held-out
  Creative Writing inputs), at each temperature, one run: tokens per step, acceptance rate,
  tokens/s, speedup over ``ar`` and, for static shapes, the DP's predicted tokens per step.
  Records are appended as they finish, so an interrupted run resumes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch

from spectot.bench.progress import progress_bar, pyplot
from spectot.bench.records import append_record, load_records, machine_info, run_identity
from spectot.config import BenchTreesOptions, DraftOptions, ModelOptions
from spectot.spec.profile import measure_costs
from spectot.pipeline import Pipeline, make_proposer, make_tree_policy
from spectot.spec.decoding import DecodeConfig, prompt_seeds
from spectot.spec.sampling import SamplingParams
from spectot.spec.trees.sequoia import expected_tokens, sequoia_tree
from spectot.spec.trees.sizing import TCurve, choose_tree_size


def measure_acceptance(
    pipe: Pipeline,
    prompts: Sequence[list[int]],
    width: int,
    sampling: SamplingParams,
    max_new_tokens: int,
    seed: int = 0,
) -> dict:
    """Positional acceptance vector p_1..p_W from star-tree decoding of ``prompts``."""
    accepted, visits = [0] * width, [0] * width
    config = DecodeConfig(max_new_tokens=max_new_tokens, sampling=sampling, method="sd", num_draft_tokens=1, seed=seed)
    for i, prompt in enumerate(prompts):
        stats = pipe.decoder.generate([prompt], config, prompt_seeds(seed, i, 1))[0].stats  # each prompt its own noise
        for r, (a, v) in enumerate(zip(stats.accepted_rank, stats.rank_visits)):
            accepted[r] += a
            visits[r] += v
    acceptance = [a / v if v else 0.0 for a, v in zip(accepted, visits)]
    return {"acceptance": acceptance, "visits": visits[0], "width": width}


def profile_costs(pipe: Pipeline, n_max: int = 64, depths: int = 8, prefix: int = 128, reps: int = 5) -> dict:
    """t(n) of the target (relative to n = 1) and c = one draft depth step / one target step."""
    return measure_costs(pipe.runner, pipe.decoder.proposer, n_max, depths, prefix, reps)


def run_bench_trees(model_opts: ModelOptions, draft_opts: DraftOptions, opts: BenchTreesOptions) -> dict:
    from spectot.data.jsonl import read_field
    from spectot.tasks.creative_writing import cot_prompt, read_inputs

    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if model_opts.threads:
        torch.set_num_threads(model_opts.threads)
    questions = read_field(
        opts.gsm8k, "question", opts.gsm8k_prompts + opts.measure_prompts, complete=True
    )  # before the model
    texts = questions[: opts.gsm8k_prompts] + [
        cot_prompt(s)
        for s in (
            read_inputs(opts.creative_writing, opts.cw_offset, opts.cw_prompts, complete=True)
            if opts.cw_prompts
            else []
        )
    ]
    pipe = Pipeline.from_options(model_opts, DraftOptions(draft="none"))
    prompts = [pipe.encode(t) for t in texts]
    measure_prompts = [pipe.encode(q) for q in questions[opts.gsm8k_prompts :]]
    config_key = run_identity(
        {**asdict(opts), **asdict(model_opts), **{f"draft_{k}": v for k, v in asdict(draft_opts).items()}}
    )
    records = load_records(out / "records.jsonl", config_key)
    # the trees are measured as trees: no prompt-lookup branch grafted on (it adds ranks past the width the
    # acceptance vectors are measured over, and the DP's predictions model none)
    draft_opts = replace(draft_opts, lookup=0)
    temperatures = [float(t) for t in opts.temperatures.split(",")]
    proposers = {}

    def proposer_for(options: DraftOptions):
        if options not in proposers:  # DraftOptions is frozen: the whole configuration is the key
            proposers[options] = make_proposer(options, pipe.target, model_opts)
        return proposers[options]

    with progress_bar() as bar:
        # 1. costs and acceptance vectors (before timing anything else: the sizing needs them)
        task = bar.add_task("profile + acceptance", total=1 + len(temperatures))
        base = replace(draft_opts, tree="chain")
        pipe.decoder.proposer = proposer_for(base)
        costs = records.get(("profile",)) or profile_costs(pipe, n_max=opts.tn_max)
        append_record(out / "records.jsonl", config_key, ("profile",), costs, records)
        bar.advance(task)
        acceptance = {}
        for temp in temperatures:
            key = ("acceptance", temp)
            if key not in records:
                pipe.decoder.proposer = proposer_for(
                    replace(draft_opts, tree="k_config", k_config=str(opts.measure_width))
                )
                got = measure_acceptance(
                    pipe,
                    measure_prompts,
                    opts.measure_width,
                    SamplingParams.from_temperature(temp),
                    opts.max_new_tokens,
                )
                append_record(out / "records.jsonl", config_key, key, got, records)
            acceptance[temp] = records[key]["acceptance"]
            bar.advance(task)
        # 2. every method at every temperature
        methods = _methods(draft_opts, opts, acceptance, costs)
        # prompt-major: a machine whose speed drifts slows every method alike (method-major hands the drift to one)
        todo = [
            (m, t, i) for t in temperatures for i in range(len(prompts)) for m in methods[t] if (m, t, i) not in records
        ]
        task = bar.add_task("bench trees", total=len(todo))
        warmed: set[tuple[str, float]] = set()
        for name, temp, i in todo:
            options = methods[temp][name]
            pipe.decoder.proposer = None if options is None else proposer_for(options)
            config = DecodeConfig(
                max_new_tokens=opts.max_new_tokens,
                sampling=SamplingParams.from_temperature(temp),
                method="ar" if options is None else "sd",
                num_draft_tokens=options.num_draft_tokens if options else 1,
                seed=i,
            )
            if (name, temp) not in warmed:  # untimed warm-up per method, in every process (a resumed one too)
                pipe.decoder.generate([prompts[0][:24]], replace(config, max_new_tokens=8))
                warmed.add((name, temp))
            # every method prefills the prompt, the draft too (not from its KV of another method's run): same
            # work, fair times
            pipe.decoder.clear_prefix_caches()
            res = pipe.decoder.generate([prompts[i]], config)[0]
            rec = {
                "tokens": res.token_ids,
                "stats": res.stats.to_dict(),
                "nodes": res.stats.proposed / max(1, res.stats.verify_steps),
            }
            append_record(out / "records.jsonl", config_key, (name, temp, i), rec, records)
            bar.advance(task)
    result = _summarize(records, methods, temperatures, len(prompts), opts.gsm8k_prompts, acceptance, costs)
    result["config"] = config_key
    result["machine"] = machine_info()
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(_markdown(result))
    _plot(result, out / "results.png")
    return result


def _methods(draft: DraftOptions, opts: BenchTreesOptions, acceptance: dict, costs: dict) -> dict:
    """name -> DraftOptions (None = ar) per temperature; Sequoia's (n, d) from the sizing rule."""
    deep = 16  # trees decide their own depth: the request's k only caps it
    per_temp = {}
    for temp, acc in acceptance.items():
        table = sequoia_tree(acc, opts.sequoia_max_nodes, opts.sequoia_max_depth).table
        curve = TCurve.from_measurements({p["n"]: p["t"] for p in costs["t_curve"]})
        extra = costs.get("c_extra_depth", 0.0)
        choice = choose_tree_size(table, curve, extra, first_draft_cost=costs.get("c", extra))
        vector = ",".join(f"{a:.6f}" for a in acc)
        per_temp[temp] = {
            "ar": None,
            "ngram_chain": DraftOptions(draft="ngram", num_draft_tokens=5),
            "chain": replace(draft, tree="chain", num_draft_tokens=opts.chain_k),
            "specinfer_5x8": replace(draft, tree="specinfer", specinfer="5x8", num_draft_tokens=deep),
            "k_config_2,2,1": replace(draft, tree="k_config", k_config="2,2,1", num_draft_tokens=deep),
            "k_config_4,2,1,1": replace(draft, tree="k_config", k_config="4,2,1,1", num_draft_tokens=deep),
            f"sequoia_n{choice.n}_d{choice.d}": replace(
                draft,
                tree="sequoia",
                acceptance=vector,
                tree_budget=choice.n,
                tree_depth=choice.d - 1,  # Sequoia's d counts the root; the flag counts draft depths
                num_draft_tokens=deep,
            ),
            f"sequoia_n{opts.sequoia_fixed}": replace(
                draft, tree="sequoia", acceptance=vector, tree_budget=opts.sequoia_fixed, num_draft_tokens=deep
            ),
            "pct": replace(
                draft, tree="pct", pct_threshold=min(0.99, costs.get("c_extra_depth", 0.1)), num_draft_tokens=deep
            ),
            "vct": replace(draft, tree="vct", num_draft_tokens=deep),
            "cape": replace(draft, tree="cape", num_draft_tokens=deep),
            "eagle2": replace(draft, tree="eagle2", tree_budget=opts.eagle2_tokens, num_draft_tokens=deep),
        }
    return per_temp


def _predicted(options: DraftOptions | None, acc: list[float]) -> float | None:
    """The positional model's expected tokens per step for static shapes (None for dynamic trees)."""
    if options is None or options.draft == "ngram" or options.tree in ("pct", "vct", "cape", "eagle2"):
        return None
    policy, _ = make_tree_policy(options)
    if policy is None:  # chain of k
        parents = [-1] + list(range(options.num_draft_tokens))
    else:
        parents = list(policy.shape)
    return expected_tokens(parents, acc)


def _summarize(records, methods, temperatures, n_prompts, n_gsm8k, acceptance, costs) -> dict:
    rows = []
    for temp in temperatures:
        ar_speed = None
        for name, options in methods[temp].items():
            for subset, idx in (
                ("all", range(n_prompts)),
                ("gsm8k", range(n_gsm8k)),
                ("creative_writing", range(n_gsm8k, n_prompts)),
            ):
                # the prompts every method has a record of: a cut run compares methods on the same prompts
                idx = [i for i in idx if all((m, temp, i) in records for m in methods[temp])]
                recs = [records[(name, temp, i)] for i in idx]
                if not recs:
                    continue
                stats = [r["stats"] for r in recs]
                tokens = sum(s["new_tokens"] for s in stats)
                seconds = sum(s["time_total"] for s in stats)
                steps = sum(s["verify_steps"] for s in stats)
                proposed = sum(s["proposed"] for s in stats)
                row = {
                    "method": name,
                    "temperature": temp,
                    "prompts": subset,
                    "tokens_per_step": (sum(s["accepted"] for s in stats) + steps) / steps if steps else 1.0,
                    "acceptance_rate": sum(s["accepted"] for s in stats) / proposed if proposed else 0.0,
                    "tree_nodes": proposed / steps if steps else 0.0,
                    "tokens_per_second": tokens / seconds,
                    "predicted_tokens_per_step": _predicted(options, acceptance[temp]),
                }
                row["prompts_compared"] = len(idx)
                if temp == 0:
                    ref = [records[("ar", temp, i)]["tokens"] for i in idx]
                    row["same_tokens_as_ar"] = sum(r["tokens"] == a for r, a in zip(recs, ref))
                rows.append(row)
        for row in rows:
            if row["temperature"] == temp and row["method"] == "ar":
                ar_speed = ar_speed or {}
                ar_speed[row["prompts"]] = row["tokens_per_second"]
        for row in rows:
            if row["temperature"] == temp and ar_speed:
                row["speedup_vs_ar"] = row["tokens_per_second"] / ar_speed[row["prompts"]]
    return {"rows": rows, "acceptance": {str(t): a for t, a in acceptance.items()}, "costs": costs}


def _markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"# bench trees — {cfg['target']} {cfg['dtype']}, draft {cfg['draft_draft']}, {cfg['gsm8k_prompts']} GSM8K + "
        f"{cfg['cw_prompts']} Creative Writing prompts, {cfg['max_new_tokens']} new tokens, {result['machine']['threads']} threads",
        "",
        f"Draft cost c (first depth / each further depth, relative to one target step): {result['costs'].get('c', 0):.3f} / "
        f"{result['costs'].get('c_extra_depth', 0):.3f}. Acceptance vectors (star tree of width {cfg['measure_width']}): "
        + "; ".join(f"T={t}: " + ", ".join(f"{a:.3f}" for a in acc) for t, acc in result["acceptance"].items()),
        "",
        "| T | method | tokens/step (incl. bonus) | DP predicted | tree nodes | acceptance rate | tokens/s | speedup vs ar | same as ar |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        if row["prompts"] != "all":
            continue
        pred = "–" if row["predicted_tokens_per_step"] is None else f"{row['predicted_tokens_per_step']:.2f}"
        same = str(row.get("same_tokens_as_ar", "–"))
        lines.append(
            f"| {row['temperature']} | {row['method']} | {row['tokens_per_step']:.2f} | {pred} | {row['tree_nodes']:.1f} | "
            f"{row['acceptance_rate']:.2f} | {row['tokens_per_second']:.1f} | {row.get('speedup_vs_ar', 0):.2f}x | {same} |"
        )
    return "\n".join(lines) + "\n"


def _plot(result: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    rows = [r for r in result["rows"] if r["prompts"] == "all" and r["method"] not in ("ar", "ngram_chain")]
    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.5), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        for r in (r for r in rows if r["temperature"] == temp):
            ax.scatter(r["tree_nodes"], r["tokens_per_step"], s=30)
            ax.annotate(
                r["method"],
                (r["tree_nodes"], r["tokens_per_step"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        ax.set_xscale("log")
        ax.set_xlabel("draft tree nodes per step (log)")
        ax.set_ylabel("tokens per step (incl. bonus)")
        ax.set_title(f"T = {temp}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
