"""The Python API and the one factory that maps configuration to engine objects.

    >>> from spectot import Pipeline
    >>> pipe = Pipeline.load("smollm2-135m", dtype="fp32", draft="ngram")
    >>> out = pipe.generate("What is 7 * 8?", max_new_tokens=32, method="sd")
    >>> out[0].text, out[0].stats.mean_acceptance_length

Names follow transformers (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import get_args

import torch

from spectot.config import DraftOptions, EngineName, Kernels, ModelOptions, check_engine_draft
from spectot.engine.runner import ModelRunner
from spectot.models.loader import DType, LoadedModel, chat_ids, check_same_vocabulary, load_model, real_tokens
from spectot.spec.decoding import (
    DecodeConfig,
    Decoder,
    FinishReason,
    Method,
    PromptRefused,
    cut_at_stop,
    decode_after,
    prompt_seeds,
)
from spectot.spec.draft_length import DraftLength, ForwardTime
from spectot.spec.proposers.base import Proposer, drafts_chains
from spectot.spec.proposers.draft_decoder import ChildSampling, DraftDecoderProposer
from spectot.spec.proposers.draft_model import DraftModelProposer
from spectot.spec.proposers.ngram import NgramProposer
from spectot.spec.sampling import SamplingParams
from spectot.spec.stats import DecodeStats
from spectot.spec.trees.dynamic import TreeBudget, TreePolicy


class PromptError(PromptRefused):
    """A prompt that cannot be decoded: ``index`` its place in the call's list, ``fault`` why ("has 9000 tokens; ...")."""

    def __init__(self, index: int, count: int, fault: str) -> None:
        super().__init__(f"prompt {index + 1} of {count} {fault}")
        self.index = index
        self.fault = fault


@dataclass
class Generation:
    prompt: str
    text: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    stats: DecodeStats

    def to_dict(self) -> dict:
        return {
            "prompt": self.prompt,
            "text": self.text,
            "prompt_ids": self.prompt_ids,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


def make_tree_policy(options: DraftOptions) -> tuple[TreePolicy | None, ChildSampling]:
    """The draft tree a draft decoder grows and how sampled siblings are drawn (None: a chain of k)."""
    from spectot.config import parse_acceptance, parse_int_list, parse_specinfer
    from spectot.spec.trees import dynamic, sequoia, shapes

    depth = options.tree_depth
    auto = {"sequoia": "without_replacement", "k_config": "without_replacement", "specinfer": "with_replacement"}
    children = options.tree_children if options.tree_children != "auto" else auto.get(options.tree, "top")
    if options.tree in ("chain", "auto"):
        return None, children
    if options.tree == "k_config":
        return dynamic.StaticPolicy(
            tuple(shapes.k_config_tree(parse_int_list(options.k_config, "--k-config")))
        ), children
    if options.tree == "specinfer":
        return dynamic.StaticPolicy(tuple(shapes.specinfer_tree(*parse_specinfer(options.specinfer)))), children
    if options.tree == "sequoia":
        # --tree-depth counts draft depths below the root, as for the dynamic trees; Sequoia's DP counts the root.
        # Without one, the tree is as deep as a step drafts (k): an unbounded optimum was cut at depth k
        tree = sequoia.sequoia_tree(
            parse_acceptance(options.acceptance), options.tree_budget, (depth or options.num_draft_tokens) + 1
        )
        return dynamic.StaticPolicy(tuple(tree.parents)), children
    if options.tree == "pct":
        return dynamic.PCTPolicy(threshold=options.pct_threshold, max_depth=depth or 8), children
    if options.tree == "vct":
        return dynamic.VCTPolicy(max_depth=depth or 5), children
    if options.tree == "cape":
        return dynamic.CAPEPolicy(max_depth=depth or 4), children
    return dynamic.EAGLE2Policy(depth=depth or 6, total_tokens=options.tree_budget), children


def make_proposer(options: DraftOptions, target: LoadedModel, model: ModelOptions) -> Proposer | None:
    if options.draft == "none":
        return None
    if options.draft == "ngram":
        return NgramProposer(max_ngram=options.ngram_max, min_ngram=options.ngram_min, width=options.ngram_width)
    folder = draft_decoder_folder(options.draft, model.target)
    if folder is not None:
        from spectot.models.draft_decoder import DraftDecoder

        decoder = DraftDecoder.load(folder, target.model, head_size=draft_head_size(options.draft_head, folder, target))
        runner = ModelRunner(
            decoder.model, max_context=target.max_context, kernels=model.kernels, exact_attention=False
        )
        policy, children = make_tree_policy(options)
        return DraftDecoderProposer(
            decoder, runner, policy, children, name=options.draft, lookup=options.lookup, coupled=options.coupled
        )
    draft = load_model(options.draft, dtype=model.dtype, device=str(target.model.device))
    check_same_vocabulary(target, draft)
    runner = ModelRunner(draft.model, max_context=draft.max_context, kernels=model.kernels, exact_attention=False)
    # a head padded to another width than the target's (one tokenizer) drafts real tokens on the target's rows
    return DraftModelProposer(runner, name=options.draft, tokens=real_tokens(target), target_rows=target.vocab_size)


def samples_its_drafts(proposer: Proposer | None) -> bool:
    """Whether the draft samples its tokens (an independent draft model, a trained draft's sampled children):
    verified by speculative sampling, it keeps the target's distribution but draws on the stream's generator,
    so a request's samples depend on how it was drafted. The n-gram draft and top-token children do not."""
    if isinstance(proposer, DraftModelProposer):
        return True
    return isinstance(proposer, DraftDecoderProposer) and proposer.children != "top"


CPU_DRAFT_HEAD = 2048  # --draft-head -1 on a CPU: see draft_head_size


def draft_head_size(asked: int, folder: Path, target: LoadedModel) -> int:
    """The head size a draft decoder is loaded with: ``asked`` unless it is -1 (auto), which cuts a ranked head
    to 2,048 tokens on a CPU and keeps it whole elsewhere. On a 2-core Xeon the shipped EDD's 8,192 head rows
    were ~60 % of a draft forward's matmul bytes; cut to 2,048 they cover 98.0 % of the target's generated tokens
    (against 98.2 %), and `bench drafts` measured 1.39x against 1.28x for the EDD chain (session 28). On a GPU
    the rows cost little and every token kept can be drafted."""
    from spectot.models.draft_decoder import DraftDecoder

    if asked >= 0:
        return asked
    on_cpu = target.model.device.type == "cpu"
    return CPU_DRAFT_HEAD if on_cpu and DraftDecoder.read_config(folder).head_ranked else 0


def draft_decoder_folder(draft: str, target: str) -> Path | None:
    """The folder of a draft decoder: 'edd'/'vdm' name the ones shipped for the target alias, a
    folder with draft.json one trained by `spectot train-draft`; None for other drafts."""
    if draft in ("edd", "vdm"):
        if (Path(draft) / "draft.json").is_file():  # the shipped draft won in silence over the user's own
            raise ValueError(
                f"--draft {draft} names both the shipped {draft} draft and a draft folder here: pass ./{draft} for "
                "the folder, or run from another folder for the shipped one"
            )
        folder = Path(__file__).parent / "models" / "drafts" / f"{target}-{draft}"
        if not (folder / "draft.json").is_file():
            raise FileNotFoundError(
                f"spectot ships no {draft} draft for target '{target}': train one with "
                f"`spectot train-draft --target {target} --kind {draft} --corpus ...` and pass its folder as --draft"
            )
        return folder
    path = Path(draft).expanduser()  # as is_draft_decoder reads it: --draft=~/edd was taken for a model
    return path if (path / "draft.json").is_file() else None


class Pipeline:
    def __init__(
        self,
        target: LoadedModel,
        proposer: Proposer | None = None,
        chat_template: bool = True,
        kernels: Kernels = "auto",
        prefix_cache: int = 16384,
    ) -> None:
        self.target = target
        self.runner = ModelRunner(target.model, max_context=target.max_context, kernels=kernels)
        self.proposer = proposer
        self.num_draft_tokens = 5  # k when a call names none: the draft options' (``from_options``)
        self.chat_template = chat_template and target.tokenizer.chat_template is not None
        tokenizer = target.tokenizer
        self.decoder = Decoder(
            self.runner,
            target.eos_token_ids,
            proposer,
            detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            prefix_cache_tokens=prefix_cache,
        )

    @classmethod
    def load(
        cls,
        target: str = "smollm2-135m",
        *,
        dtype: DType = "bf16",
        draft: str = "none",
        threads: int = 0,
        chat_template: bool = True,
        kernels: Kernels = "auto",
        ngram_max: int = 3,
        ngram_min: int = 1,
        adaptive_k: bool = True,
        device: str = "auto",
        prefix_cache: int = 16384,
    ) -> Pipeline:
        """``from_options`` with the common flags as arguments (``ModelOptions`` / ``DraftOptions`` hold them all)."""
        model = ModelOptions(
            target=target,
            dtype=dtype,
            device=device,
            threads=threads,
            chat_template=chat_template,
            kernels=kernels,
            prefix_cache=prefix_cache,
        )
        return cls.from_options(
            model, DraftOptions(draft=draft, ngram_max=ngram_max, ngram_min=ngram_min, adaptive_k=adaptive_k)
        )

    @classmethod
    def from_options(cls, model: ModelOptions, draft: DraftOptions) -> Pipeline:
        if model.threads:
            torch.set_num_threads(model.threads)
        target = load_model(model.target, dtype=model.dtype, device=model.device)
        proposer = make_proposer(draft, target, model)
        pipe = cls(
            target, proposer, chat_template=model.chat_template, kernels=model.kernels, prefix_cache=model.prefix_cache
        )
        pipe.num_draft_tokens = draft.num_draft_tokens  # the k its tree was checked and planned against
        if draft.adaptive_k and drafts_chains(proposer):
            pipe.decoder.draft_length = adaptive_draft_length(
                draft, model, measure_solve_costs(pipe, proposer), proposer
            )
        if draft.tree == "pct" and isinstance(proposer, DraftDecoderProposer):
            size_pct_trees(proposer, measure_solve_costs(pipe, proposer))
        return pipe

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """The prompt's ids: a user message through the chat template (unless --no-chat-template, a tokenizer
        without one, or ``chat`` False: a task whose prompts are plain-text continuations), else the text."""
        tokenizer = self.target.tokenizer
        if self.chat_template and chat:
            return chat_ids(tokenizer, [{"role": "user", "content": prompt}])
        return list(tokenizer(prompt)["input_ids"])

    def generate(
        self,
        prompts: str | Sequence[str],
        *,
        max_new_tokens: int = 128,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        method: Method | None = None,  # None: sd with the pipeline's draft, ar without one
        num_draft_tokens: int | None = None,  # None: the pipeline's (its DraftOptions')
        stop: Sequence[str] | None = (),
        seed: int = 0,
        batch_size: int = 1,
        on_batch: Callable[[list[Generation]], None] | None = None,
        first_index: int = 0,
    ) -> list[Generation]:
        """Decode ``prompts`` ``batch_size`` at a time; ``on_batch`` gets each batch's generations as soon
        as it finishes (a long job writes them out and can resume from there). Prompt i is seeded by
        ``prompt_seeds(seed, first_index + i)`` (``first_index``: where ``prompts`` start in the job's list), so
        its samples do not depend on the batch size or the point a run resumed from."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        method = method or ("ar" if self.proposer is None else "sd")
        stop = () if stop is None else stop
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if method == "sd" and self.proposer is None:
            raise ValueError("method 'sd' needs a draft: load the pipeline with draft='ngram' or a draft model")
        config = DecodeConfig(
            max_new_tokens=max_new_tokens,
            sampling=SamplingParams(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p),
            method=method,
            num_draft_tokens=self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),  # one stop string given bare
            seed=seed,
        )
        encoded = [self.encode(p) for p in prompts]
        for i, ids in enumerate(encoded):  # all before any decoding: a bad last prompt costs no finished work
            if (fault := self.decoder.prompt_fault(ids, config)) is not None:
                raise PromptError(i, len(prompts), fault)
        results: list[Generation] = []
        seeds = prompt_seeds(seed, first_index, len(prompts))
        for first in range(0, len(prompts), batch_size):
            chunk = prompts[first : first + batch_size]
            outs = self.decoder.generate(encoded[first : first + batch_size], config, seeds[first : first + batch_size])
            batch = [self._finish(p, out, config.stop) for p, out in zip(chunk, outs)]
            if on_batch is not None:
                on_batch(batch)
            results += batch
        return results

    def _finish(self, prompt: str, out, stop: tuple[str, ...]) -> Generation:
        text = decode_after(self.decoder.detokenize, out.prompt_ids, out.token_ids)
        if out.finish_reason == "stop":
            text = cut_at_stop(text, stop)
        return Generation(prompt, text, out.prompt_ids, out.token_ids, out.finish_reason, out.stats)


# -- engines for a search level (schedulers/) -------------------------------------------------------
def make_engine(pipe: Pipeline, name: str, draft: DraftOptions, model: ModelOptions, costs: dict | None = None):
    """(engine, decoding method) for ``spectot solve --engine``: each engine gets its own decoder over
    the pipeline's target runner, with the draft tree its schedule calls for (``--tree auto``)."""
    from dataclasses import replace

    from spectot.schedulers.batched import BatchedEngine
    from spectot.schedulers.chained import ContinuousLevelEngine
    from spectot.schedulers.continuous import ContinuousEngine
    from spectot.schedulers.seed import SeedEngine
    from spectot.schedulers.serial import SerialEngine

    if name not in get_args(EngineName):  # before any draft is loaded
        raise ValueError(f"unknown engine '{name}': one of {', '.join(get_args(EngineName))}")
    check_engine_draft(name, draft.draft)

    def decoder(proposer: Proposer | None, draft_length: DraftLength | None = None) -> Decoder:
        return Decoder(
            pipe.runner,
            pipe.target.eos_token_ids,
            proposer,
            pipe.decoder.detokenize,
            prefix_cache=pipe.decoder.prefix_cache,  # one cache per runner: every engine finds what ran before
            draft_length=draft_length,
        )

    if name == "hf-batched-ar":
        from spectot.schedulers.hf import HFBatchedEngine

        target = pipe.target
        return HFBatchedEngine(target.model, target.eos_token_ids, pipe.decoder.detokenize, target.max_context), "ar"
    if name in ("ar", "batched-ar"):
        engine = SerialEngine(decoder(None), "ar") if name == "ar" else BatchedEngine(decoder(None), "batched-ar")
        return engine, "ar"
    if name == "continuous-ar":
        return ContinuousLevelEngine(ContinuousEngine(decoder(None)), name), "ar"
    auto = {"sd": "chain", "mcsd": "k_config", "seed": "k_config"}
    tree = draft.tree if draft.tree != "auto" else auto.get(name, "chain")
    shaped = {"tree": tree}
    if draft.tree == "auto" and tree == "k_config" and draft.k_config == DraftOptions.k_config:
        # the engine's own default tree (2,2,1), as deep as a step drafts where k is smaller
        shaped["k_config"] = ",".join(draft.k_config.split(",")[: draft.num_draft_tokens])
    proposer = make_proposer(replace(draft, **shaped), pipe.target, model)

    def machine_costs() -> dict:  # t(n) and c, measured once and only where needed
        nonlocal costs
        costs = costs or measure_solve_costs(pipe, proposer)
        return costs

    budget = None
    if (
        name in ("batched-sd", "seed-batched", "continuous-sd")
        and draft.tree == "auto"
        and isinstance(proposer, DraftDecoderProposer)
    ):
        budget = tree_by_streams(
            draft_acceptance(draft, model.target), machine_costs(), max_depth=min(8, draft.num_draft_tokens + 1)
        )
    if tree == "pct" and isinstance(proposer, DraftDecoderProposer):  # as Pipeline.from_options does
        size_pct_trees(proposer, machine_costs())
    draft_length = None
    if budget is None and draft.adaptive_k and drafts_chains(proposer):  # each engine learns its own acceptance
        draft_length = adaptive_draft_length(draft, model, machine_costs(), proposer)
    if name in ("sd", "mcsd"):
        return SerialEngine(decoder(proposer, draft_length), name), "sd"
    if name == "batched-sd":
        return BatchedEngine(decoder(proposer, draft_length), name, budget), "sd"
    if name in ("seed", "seed-batched"):
        engine = SeedEngine(decoder(proposer, draft_length), name, batched=name == "seed-batched", budget=budget)
        return engine, "sd"
    if name == "continuous-sd":
        return ContinuousLevelEngine(ContinuousEngine(decoder(proposer, draft_length), budget=budget), name), "sd"
    raise ValueError(f"unknown engine '{name}'")


def draft_acceptance(draft: DraftOptions, target: str) -> dict[float, list[float]] | None:
    """The draft's positional acceptance vectors by sampling temperature: --acceptance (for every
    temperature), else the ones shipped with the draft (``acceptance.json``)."""
    from spectot.config import acceptance_by_temperature, parse_acceptance

    if draft.acceptance:
        return {0.0: parse_acceptance(draft.acceptance)}
    folder = draft_decoder_folder(draft.draft, target)
    if folder is not None and (folder / "acceptance.json").is_file():
        return acceptance_by_temperature(str(folder / "acceptance.json"))
    return None


def adaptive_draft_length(draft: DraftOptions, model: ModelOptions, costs: dict, proposer: Proposer) -> DraftLength:
    """k* (and, for a draft decoder, w*) per step (``spec/draft_length.py``) from this machine's t(n) and draft
    cost c, with the draft's measured acceptance vector by temperature as the prior where it ships one (its
    first entry for the chain's first token, the next ones for the runners-up)."""
    from spectot.spec.trees.sizing import TCurve

    acceptance = draft_acceptance(draft, model.target) or {}
    priors = {t: vector[0] for t, vector in acceptance.items() if vector} or None
    runners_up = {t: vector[1:] for t, vector in acceptance.items() if len(vector) > 1} or None
    width = (draft.draft_width or fan_width(costs["t_curve"])) if isinstance(proposer, DraftDecoderProposer) else 1
    curve = TCurve.from_measurements(costs["t_curve"], normalise=False)
    profile = [(point["n"], point["seconds"]) for point in costs["t_curve"] if "seconds" in point]
    forward_time = ForwardTime(profile, costs.get("context", SOLVE_COST_CONTEXT)) if profile else None
    return DraftLength(
        curve,
        float(costs.get("c", 0.0)),
        priors,
        forward_time=forward_time,
        max_width=width,
        runner_up_priors=runners_up,
    )


FAN_WIDTH = 4  # candidates for the first draft token where rows are nearly free
FREE_ROWS = 1.15  # t(8) / t(1) at most: "nearly free" (an H200: 1.08; a 2-core Zen 5: 1.33)


def fan_width(t_curve: list[dict]) -> int:
    """--draft-width 0: FAN_WIDTH where this machine's forward of 8 rows (or its largest measured count up to 8)
    costs at most FREE_ROWS times one row's, else 1 (chains). Only a draft decoder grows fans."""
    points = {p["n"]: p["seconds"] for p in t_curve if "seconds" in p}
    wide = max((n for n in points if 1 < n <= 8), default=None)
    if 1 not in points or wide is None:
        return 1
    return FAN_WIDTH if points[wide] <= FREE_ROWS * points[1] else 1


def size_pct_trees(proposer: DraftDecoderProposer, costs: dict) -> None:
    """Give a PCT proposer this machine's t(n), so it verifies only the tree size that pays (one stream
    per forward; ``PCTPolicy.verify_cost``)."""
    from spectot.spec.trees.dynamic import PCTPolicy
    from spectot.spec.trees.sizing import TCurve

    if isinstance(proposer.policy, PCTPolicy):
        curve = TCurve.from_measurements(costs["t_curve"], normalise=False)
        proposer.policy = replace(proposer.policy, verify_cost=curve)


SOLVE_COST_CONTEXT = 256  # tokens before measure_solve_costs' forwards


def measure_solve_costs(pipe: Pipeline, proposer: Proposer, context: int = SOLVE_COST_CONTEXT) -> dict:
    """A quick t(n) (``T_CURVE_ROWS``, then 64) and the draft cost c on this machine (a few seconds), after
    ``context`` tokens: where decoding runs (search prompts hold 300-500 tokens, GSM8K answers end at
    100-350). Rows cost more after a long context: t(8) = 1.20 after 384 tokens, 1.09 after 64 (Zen 5)."""
    from spectot.spec.profile import T_CURVE_ROWS, measure_costs

    room = pipe.runner.max_context
    context = max(1, min(context, room // 4))  # a short-context model measures after fewer tokens
    ns = tuple(n for n in (*T_CURVE_ROWS, 64) if context + n + 8 <= room)  # + 8: the draft's depths and root
    costs = measure_costs(pipe.runner, proposer, ns=ns, depths=4, prefix=context, reps=2)
    return {**costs, "context": context}


def tree_by_streams(
    acceptance: dict[float, list[float]] | None, costs: dict, max_nodes: int = 32, max_depth: int = 8
) -> TreeBudget | None:
    """(B, sampling) -> the Sequoia tree per stream that Sequoia's hardware-aware rule picks when B
    streams share each forward (few streams -> big trees, many -> small), from the acceptance
    vector measured at the temperature nearest the streams' (greedy = 0): a draft accepts less of
    temperature-1 thoughts than of greedy values, so their trees are smaller. ``max_depth`` counts the root:
    at most the requests' k + 1 (a step drafts k deep; a deeper tree would be cut, unlike its plan)."""
    from functools import cache

    from spectot.spec.trees.dynamic import StaticPolicy
    from spectot.spec.trees.sequoia import sequoia_tree
    from spectot.spec.trees.sizing import TCurve, choose_tree_size

    if not acceptance:
        return None
    curve = TCurve.from_measurements(costs["t_curve"], normalise=False)
    c = float(costs.get("c", 0.0))  # a step's first draft forward: catch-up + one depth
    c_extra = float(costs.get("c_extra_depth", c))  # each further depth

    @cache
    def tree(streams: int, measured_at: float) -> StaticPolicy:
        vector = acceptance[measured_at]
        table = sequoia_tree(vector, max_nodes, max_depth).table
        choice = choose_tree_size(table, curve, c_extra, streams=streams, first_draft_cost=c)
        return StaticPolicy(tuple(sequoia_tree(vector, choice.n, choice.d).parents))

    def policy(streams: int, sampling: SamplingParams) -> StaticPolicy:
        return tree(max(1, streams), sampling.nearest(acceptance))

    return policy
