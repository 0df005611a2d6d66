"""Typed configuration: the single source of the CLI flags (``cli/flags.py`` reads these fields).

Every field carries its help text; ``Literal`` fields become choices. Validation happens here,
eagerly, with messages that say how to fix the input. No torch import: ``spectot --help`` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DType = Literal["bf16", "fp32", "fp16"]
Method = Literal["ar", "sd"]
Kernels = Literal["auto", "torch", "spectot"]


def opt(help: str, **kw) -> dict:
    return dict(metadata={"help": help, **kw})


@dataclass(frozen=True)
class ModelOptions:
    target: str = field(
        default="smollm2-135m", **opt("target model: alias (see `spectot models`), local path or hub id")
    )
    dtype: DType = field(default="bf16", **opt("weights and compute dtype: bf16 is fast, fp32 is exact"))
    threads: int = field(default=0, **opt("CPU threads for torch (0 = torch's default)"))
    chat_template: bool = field(default=True, **opt("wrap prompts in the tokenizer's chat template (instruct models)"))
    kernels: Kernels = field(
        default="auto",
        **opt(
            "matmul kernels: 'auto' uses spectot's batch-invariant AVX2 bf16 kernel on CPUs without native bf16 "
            "(tree forwards then cost about one token), 'torch' always uses torch's"
        ),
    )

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0, got {self.threads}")


@dataclass(frozen=True)
class DraftOptions:
    draft: str = field(
        default="ngram",
        **opt("draft: 'none', 'ngram' (prompt lookup, no model), or a model alias/path sharing the target's tokenizer"),
    )
    num_draft_tokens: int = field(default=5, **opt("k: draft tokens verified per target forward (sd)"))
    ngram_max: int = field(default=3, **opt("longest n-gram the prompt-lookup draft matches"))
    ngram_min: int = field(default=1, **opt("shortest n-gram the prompt-lookup draft matches"))
    ngram_width: int = field(
        default=1, **opt("n-gram draft tree width: continuations of the N latest distinct matches")
    )

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"--num-draft-tokens must be >= 1, got {self.num_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= --ngram-min <= --ngram-max, got {self.ngram_min}, {self.ngram_max}")
        if self.ngram_width < 1:
            raise ValueError(f"--ngram-width must be >= 1, got {self.ngram_width}")


@dataclass(frozen=True)
class SamplingOptions:
    max_new_tokens: int = field(default=128, **opt("tokens to generate per prompt at most"))
    temperature: float = field(default=0.0, **opt("sampling temperature; 0 = greedy"))
    top_k: int = field(default=0, **opt("keep the k most likely tokens (0 = off)"))
    top_p: float = field(default=1.0, **opt("nucleus sampling mass (1 = off)"))
    seed: int = field(default=0, **opt("random seed: same seed, same output"))
    stop: tuple[str, ...] = field(default=(), **opt("stop string (repeatable)", action="append"))

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class GenerateOptions:
    method: Method = field(default="sd", **opt("ar: autoregressive baseline; sd: chain speculative decoding"))
    prompt: str | None = field(default=None, **opt("one prompt text"))
    prompts: str | None = field(default=None, **opt("JSONL file of prompts (one object per line)"))
    field_name: str = field(default="question", **opt("JSON field holding the prompt in --prompts", flag="--field"))
    limit: int = field(default=0, **opt("use only the first N prompts of --prompts (0 = all)"))
    batch_size: int = field(default=1, **opt("prompts decoded together, one target forward per step for all"))
    json: bool = field(default=False, **opt("print one JSON object per prompt (text, token ids, stats)"))

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompts is None):
            raise ValueError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")


@dataclass(frozen=True)
class BenchGenerateOptions:
    data: str = field(default="../shared/data/gsm8k/test.jsonl", **opt("GSM8K-style JSONL (field 'question')"))
    num_prompts: int = field(default=20, **opt("first N questions"))
    max_new_tokens: int = field(default=128, **opt("tokens per prompt"))
    out: str = field(default="runs/bench_generate", **opt("output folder (JSON, Markdown, PNG)"))
    tn_max: int = field(default=64, **opt("largest n of the t(n) curve"))
    prompt_lookup_tokens: int = field(default=10, **opt("transformers prompt_lookup_num_tokens"))
    repeats: int = field(default=1, **opt("timed passes per method (the best is reported)"))


@dataclass(frozen=True)
class TreeSequoiaOptions:
    acceptance: str = field(
        default="",
        **opt("acceptance vector: comma-separated p_1,p_2,... or a JSON file with an 'acceptance' list (tree measure)"),
    )
    budget: int = field(default=16, **opt("tree size n: nodes including the root"))
    max_depth: int = field(default=0, **opt("depth bound d, root = depth 1 (0 = unbounded)"))
    json: bool = field(default=False, **opt("print the tree and G(n, d) as JSON"))

    def __post_init__(self) -> None:
        if not self.acceptance:
            raise ValueError("--acceptance is required: e.g. --acceptance 0.6,0.2,0.1 or a JSON file")
        if self.budget < 1:
            raise ValueError(f"--budget must be >= 1, got {self.budget}")
        if self.max_depth < 0:
            raise ValueError(f"--max-depth must be >= 0 (0 = unbounded), got {self.max_depth}")


@dataclass(frozen=True)
class TrainDraftOptions:
    kind: Literal["edd", "vdm"] = field(
        default="edd", **opt("edd: one layer reading the target's hidden states; vdm: small independent draft")
    )
    corpus: tuple[str, ...] = field(
        default=(),
        **opt(
            "JSONL corpus file (repeatable): `spectot generate --json` output, GSM8K question/answer, or {'text'}",
            action="append",
        ),
    )
    out: str = field(default="runs/draft", **opt("output folder: draft.safetensors + draft.json, checkpoint, features"))
    features: str = field(
        default="", **opt("folder for the target's extracted features (default OUT/features; share it between runs)")
    )
    layers: int = field(default=0, **opt("decoder layers (0 = 1 for edd, 2 for vdm)"))
    hidden_layer: int = field(default=-4, **opt("target hidden_states index EDD reads (-4 = 4th-to-last)"))
    no_hidden: bool = field(default=False, **opt("ablation: train an EDD-shaped draft without the hidden states"))
    head_vocab: int = field(default=8192, **opt("draft head size: the corpus's most frequent tokens (q = 0 elsewhere)"))
    top_k: int = field(default=64, **opt("target probabilities kept per token for the KL loss"))
    max_len: int = field(default=384, **opt("tokens per corpus sequence at most"))
    block_min: int = field(default=5, **opt("shortest dual-block length L"))
    block_max: int = field(default=10, **opt("longest dual-block length L"))
    loss: Literal["kl", "ce"] = field(
        default="kl", **opt("kl: KL(P_target || P_draft); ce: cross-entropy on the target's argmax")
    )
    lr: float = field(default=1e-4, **opt("AdamW learning rate"))
    batch_tokens: int = field(default=2048, **opt("padded tokens per training batch"))
    epochs: float = field(default=1.0, **opt("passes over the corpus"))
    seed: int = field(default=0, **opt("seed: data order and block lengths"))
    checkpoint_minutes: float = field(default=5.0, **opt("minutes between checkpoints"))
    resume: bool = field(default=False, **opt("continue from OUT/checkpoint.pt"))

    def __post_init__(self) -> None:
        if not self.corpus:
            raise ValueError("--corpus is required (repeatable): e.g. --corpus ../shared/data/gsm8k/train.jsonl")
        if not 1 <= self.block_min <= self.block_max:
            raise ValueError(f"need 1 <= --block-min <= --block-max, got {self.block_min}, {self.block_max}")
        if self.layers < 0 or self.head_vocab < 2 or self.top_k < 1 or self.max_len < 2:
            raise ValueError("--layers >= 0, --head-vocab >= 2, --top-k >= 1 and --max-len >= 2 are required")
        if not (self.lr > 0 and self.epochs > 0 and self.batch_tokens > 0):
            raise ValueError("--lr, --epochs and --batch-tokens must be positive")
