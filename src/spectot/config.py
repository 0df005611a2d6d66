"""Typed configuration: the single source of the CLI flags (``cli/flags.py`` reads these fields).

Every field carries its help text; ``Literal`` fields become choices. Validation happens here,
eagerly, with messages that say how to fix the input. No torch import: ``spectot --help`` stays fast.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

DType = Literal["bf16", "fp32", "fp16"]
Method = Literal["ar", "sd"]
Kernels = Literal["auto", "torch", "spectot", "tiled"]
MAX_TREE_NODES = 1024  # a draft tree's nodes at most: one target forward verifies them all, so larger never pays


TreeKind = Literal["auto", "chain", "k_config", "specinfer", "sequoia", "pct", "vct", "cape", "eagle2"]
TreeChildren = Literal["auto", "top", "without_replacement", "with_replacement"]


def opt(help: str, **kw) -> dict:
    return dict(metadata={"help": help, **kw})


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers like 2,2,1, got '{text}'") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{flag}: every entry must be >= 1, got '{text}'")
    return values


def parse_names(text: str, flag: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """'a,b' -> ('a', 'b'), every name one of ``allowed``."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in names if x not in allowed]
    if not names or unknown:
        raise ValueError(f"{flag}: choose from {', '.join(allowed)} (comma-separated), got '{text}'")
    return names


def parse_temperatures(text: str, flag: str) -> tuple[float, ...]:
    """'0,0.6' -> (0.0, 0.6): finite temperatures >= 0."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated temperatures like 0,0.6, got '{text}'") from None
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"{flag}: temperatures must be finite and >= 0, got '{text}'")
    return values


def require_finite(**values: float) -> None:
    """Float flags are parsed by float(), which takes 'inf' and 'nan': refuse them by name."""
    for name, value in values.items():
        if not math.isfinite(value):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {value}")


def writable_file(path: str, flag: str) -> None:
    """A file the command writes after its work, refused before the work when it could not be written then (a
    folder in its place, a file where a folder of its path should be, a folder this user cannot write)."""
    out = Path(path).expanduser()
    if out.is_dir():
        raise ValueError(f"{flag} {path}: is a directory, expected a file")
    folder = out.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: cannot write in {folder}")


def fresh_output(path: str, flag: str) -> None:
    """A results file the command empties first must not hold an earlier run's results."""
    writable_file(path, flag)
    out = Path(path)
    if out.is_file() and out.stat().st_size:
        raise ValueError(f"{flag} {path}: already holds results; move it away or choose another file")


def parse_specinfer(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"--specinfer: expected KxL with K, L >= 1 (e.g. 5x8), got '{text}'")
    return int(parts[0]), int(parts[1])


def parse_acceptance(text: str) -> list[float]:
    """An acceptance vector from 'p1,p2,...' or a JSON file with an 'acceptance' list."""
    import json
    from pathlib import Path

    if Path(text).is_file():
        try:
            values = json.loads(Path(text).read_text())["acceptance"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{text}: expected a JSON object with an 'acceptance' list ({err})") from None
    else:
        try:
            values = [float(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"acceptance: '{text}' is neither a file nor comma-separated numbers") from None
    return _checked_acceptance(values)


def acceptance_by_temperature(path: str) -> dict[float, list[float]]:
    """A draft's acceptance vectors by sampling temperature from its ``acceptance.json``: the
    'acceptance_by_temperature' table when the file has one, else {its 'temperature' (0): 'acceptance'}."""
    import json
    from pathlib import Path

    record = json.loads(Path(path).read_text())
    table = record.get("acceptance_by_temperature") if isinstance(record, dict) else None
    if not table:
        return {float(record.get("temperature", 0.0)): parse_acceptance(path)}
    try:
        return {float(t): _checked_acceptance(v) for t, v in table.items()}
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: bad 'acceptance_by_temperature' ({err})") from None


def _checked_acceptance(values: object) -> list[float]:
    numbers = isinstance(values, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if not numbers or not values or any(not 0 <= v <= 1 for v in values) or sum(values) > 1 + 1e-6:
        raise ValueError(f"acceptance: need probabilities in [0, 1] summing to <= 1, got {values}")
    return [float(v) for v in values]


@dataclass(frozen=True)
class ModelOptions:
    target: str = field(
        default="smollm2-135m", **opt("target model: alias (see `spectot models`), local path or hub id")
    )
    dtype: DType = field(default="bf16", **opt("weights and compute dtype: bf16 is fast, fp32 is exact"))
    device: str = field(
        default="auto",
        **opt(
            "where the models run: 'auto' (the first CUDA GPU if torch sees one, else the CPU), 'cpu', 'cuda', 'cuda:N'"
        ),
    )
    threads: int = field(default=0, **opt("CPU threads for torch (0 = torch's default)"))
    chat_template: bool = field(default=True, **opt("wrap prompts in the tokenizer's chat template (instruct models)"))
    kernels: Kernels = field(
        default="auto",
        **opt(
            "bf16 kernels on the CPU: 'auto' uses spectot's batch-invariant matmul (AVX2, AVX512-BF16 or AMX "
            "tiles, whichever the CPU has) and fused layer ops where they build, 'spectot' always, 'torch' never; "
            "'tiled': torch's matmul on fixed row tiles (8 on a CPU, 64 on a GPU): bit-exact fp32 (torch's own "
            "rounds a row by how many share the forward; 1.6-1.9x the time on SmolLM2 here) and batch-invariant "
            "bf16 on a GPU (not yet measured there). "
            "Attention and sampling keep spectot's native batch-invariant kernels under every choice where they "
            "build: they make batched verification exact"
        ),
    )
    prefix_cache: int = field(
        default=16384,
        **opt("KV tokens of finished sequences kept so later prompts that extend them skip that prefill (0 = off)"),
    )

    def __post_init__(self) -> None:
        cores = os.cpu_count() or 1
        if not 0 <= self.threads <= 4 * cores:  # thousands of OpenMP / BLAS threads crash the process
            raise ValueError(
                f"--threads must be in [0, {4 * cores}] (this machine has {cores} cores), got {self.threads}"
            )
        if self.dtype not in get_args(DType):  # the CLI's choices check it; the Python API passes any string
            raise ValueError(f"--dtype must be one of {', '.join(get_args(DType))}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.removeprefix("cuda:").isdigit():
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got '{self.device}'")
        if self.prefix_cache < 0:
            raise ValueError(f"--prefix-cache must be >= 0 tokens, got {self.prefix_cache}")


@dataclass(frozen=True)
class DraftOptions:
    draft: str = field(
        default="ngram",
        **opt(
            "draft: 'none', 'ngram' (prompt lookup, no model), 'edd' / 'vdm' (spectot's trained drafts for the "
            "target), a `spectot train-draft` folder, or a model alias/path sharing the target's tokenizer"
        ),
    )
    num_draft_tokens: int = field(default=5, **opt("k: draft tokens verified per target forward (sd)"))
    adaptive_k: bool = field(
        default=True,
        **opt(
            "chain drafts: take k <= --num-draft-tokens each step from the acceptance so far and this machine's "
            "t(n) (k = 0 skips the draft when it cannot pay); --no-adaptive-k keeps k fixed"
        ),
    )
    draft_width: int = field(
        default=0,
        **opt(
            "adaptive k with a trained draft (edd/vdm): also verify up to N candidates for the first draft token "
            "where its runners-up pay (1: chains only; 0: 4 where this machine's t(8) <= 1.15 t(1), rows nearly "
            "free as on a GPU, else 1: on a 2-core CPU fans did not pay)"
        ),
    )
    ngram_max: int = field(default=3, **opt("longest n-gram the prompt-lookup draft matches"))
    ngram_min: int = field(default=1, **opt("shortest n-gram the prompt-lookup draft matches"))
    ngram_width: int = field(
        default=1, **opt("n-gram draft tree width: continuations of the N latest distinct matches")
    )
    draft_head: int = field(
        default=-1,
        **opt(
            "trained drafts (edd/vdm): keep only the N most frequent tokens of the draft's ranked head (q = 0 "
            "elsewhere, still lossless); 0: the whole head; -1: 2048 on a CPU (where the head's rows are most "
            "of a draft step) if the head is ranked, else the whole head"
        ),
    )
    lookup: int = field(
        default=2,
        **opt(
            "trained drafts (edd/vdm): also verify the prompt-lookup continuation of a trailing match of >= N "
            "tokens, grafted below the draft's chain or tree as one more branch (greedy and top-token drafts; 0: off)"
        ),
    )

    tree: TreeKind = field(
        default="auto",
        **opt(
            "draft tree of a draft decoder (edd/vdm): auto (generate: chain; solve: the engine's own: sd chain, "
            "mcsd/seed k_config, seed-batched/batched-sd/continuous-sd Sequoia trees sized for the running streams), chain, k_config (--k-config), specinfer (--specinfer KxL), "
            "sequoia (DP tree for --acceptance, --tree-budget, --tree-depth), or dynamic: pct, vct, cape, eagle2"
        ),
    )
    coupled: bool = field(
        default=True,
        **opt(
            "trained drafts, sampling: guess token j as argmax q / E_j with the noise the target draws it with "
            "(accepted more often at T = 1; the output is the same), else the draft's argmax"
        ),
    )
    tree_children: TreeChildren = field(
        default="auto",
        **opt(
            "how sampled trees pick siblings: top (the draft's top-k, verified as deterministic), "
            "without_replacement (Sequoia), with_replacement (SpecInfer/MCSD); auto: sequoia and k_config "
            "without, specinfer with, dynamic trees top. Greedy decoding always uses top"
        ),
    )
    k_config: str = field(default="2,2,1", **opt("k_config tree: children per node at each depth, e.g. 4,2,1,1"))
    specinfer: str = field(default="5x5", **opt("specinfer tree: K independent sequences of length L (<= k), as KxL"))
    tree_budget: int = field(
        default=16, **opt("sequoia: tree size n incl. the root; eagle2: tokens kept after reranking")
    )
    tree_depth: int = field(
        default=0,
        **opt("sequoia/dynamic trees: most draft tokens deep below the pending root (0 = the tree's default)"),
    )
    acceptance: str = field(
        default="", **opt("sequoia: acceptance vector p_1,p_2,... or the JSON file `spectot tree measure` wrote")
    )
    pct_threshold: float = field(
        default=0.1,
        **opt("PCT: expand a node while its path confidence >= this (s_d / s_t, the draft/target step-time ratio)"),
    )

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"--num-draft-tokens must be >= 1, got {self.num_draft_tokens}")
        if self.draft_width < 0:
            raise ValueError(f"--draft-width counts candidates (0: by this machine's t(n)), got {self.draft_width}")
        if self.lookup < 0:
            raise ValueError(f"--lookup is a match length (>= 1) or 0 for off, got {self.lookup}")
        if self.draft_head < -1:
            raise ValueError(f"--draft-head counts tokens (0: the whole head, -1: auto), got {self.draft_head}")
        deep, shape = self.tree_depth, f"--tree-depth {self.tree_depth}"  # how deep the tree drafts
        if self.tree == "k_config":
            deep, shape = len(parse_int_list(self.k_config, "--k-config")), f"--k-config {self.k_config}"
        if self.tree == "specinfer":
            deep, shape = parse_specinfer(self.specinfer)[1], f"--specinfer {self.specinfer}"
        if self.tree == "sequoia" and not self.acceptance:
            raise ValueError("--tree sequoia needs --acceptance (measure it with `spectot tree measure`)")
        if self.acceptance:  # read now: the engines that size trees by it read it after the model loaded
            parse_acceptance(self.acceptance)
        if self.tree in ("pct", "eagle2", "cape") and self.tree_children in ("with_replacement", "without_replacement"):
            raise ValueError(
                f"--tree {self.tree} keeps or drops siblings by their own draft probability, so sampled siblings "
                "would no longer be the independent (or without-replacement) draws from q that verification "
                "assumes: use --tree-children top (the default) or auto"
            )
        if not 1 <= self.tree_budget <= MAX_TREE_NODES or self.tree_depth < 0:
            raise ValueError(
                f"--tree-budget must be in [1, {MAX_TREE_NODES}] (one forward verifies the tree: larger ones never "
                f"pay) and --tree-depth >= 0, got {self.tree_budget} and {self.tree_depth}"
            )
        if not 0 <= self.pct_threshold < 1:
            raise ValueError(f"--pct-threshold must be in [0, 1), got {self.pct_threshold}")
        if deep > self.num_draft_tokens:  # a step drafts at most k deep: a deeper tree would be cut, unlike its plan
            raise ValueError(
                f"{shape} drafts {deep} tokens deep, past --num-draft-tokens {self.num_draft_tokens} (a step drafts "
                f"at most that deep: the rest of the tree would be cut): pass --num-draft-tokens {deep}"
            )
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
        require_finite(temperature=self.temperature)
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if "" in self.stop:
            raise ValueError("--stop '' would stop before the first token: give each stop string some text")
        if self.temperature == 0 and (self.top_k or self.top_p < 1):  # greedy decoding reads neither
            raise ValueError("--top-k / --top-p shape sampling; --temperature 0 decodes greedily: give a temperature")


@dataclass(frozen=True)
class GenerateOptions:
    method: Method = field(default="sd", **opt("ar: autoregressive baseline; sd: chain speculative decoding"))
    prompt: str | None = field(default=None, **opt("one prompt text"))
    prompts: str | None = field(default=None, **opt("JSONL file of prompts (one object per line)"))
    field_name: str = field(default="question", **opt("JSON field holding the prompt in --prompts", flag="--field"))
    offset: int = field(default=0, **opt("skip the first N prompts of --prompts"))
    limit: int = field(default=0, **opt("use only N prompts of --prompts, from --offset (0 = all)"))
    batch_size: int = field(default=1, **opt("prompts decoded together, one target forward per step for all"))
    json: bool = field(default=False, **opt("print one JSON object per prompt (text, token ids, stats)"))
    out: str | None = field(
        default=None,
        **opt(
            "append one JSON object per prompt to FILE as each batch finishes; rerun the same command to "
            "resume after the last batch written"
        ),
    )

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompts is None):
            raise ValueError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.offset < 0 or self.limit < 0:
            raise ValueError("--offset and --limit count prompts: they must be >= 0")
        if self.prompt is not None and (self.offset or self.limit):
            raise ValueError("--offset and --limit pick prompts of --prompts FILE; --prompt gives one")
        if self.prompt is not None:
            _refuse_unread(_set(self, "field_name"), "names a field of --prompts FILE; --prompt TEXT")
        if self.out and self.json:
            raise ValueError("--out FILE writes the JSON lines there; --json prints them instead: pick one")


@dataclass(frozen=True)
class BenchGenerateOptions:
    data: str = field(default="../shared/data/gsm8k/test.jsonl", **opt("GSM8K-style JSONL (field 'question')"))
    num_prompts: int = field(default=20, **opt("first N questions"))
    max_new_tokens: int = field(default=128, **opt("tokens per prompt"))
    out: str = field(default="runs/bench_generate", **opt("output folder (JSON, Markdown, PNG)"))
    tn_max: int = field(default=64, **opt("largest n of the t(n) curve"))
    prompt_lookup_tokens: int = field(default=10, **opt("transformers prompt_lookup_num_tokens"))
    repeats: int = field(default=1, **opt("timed passes per method (the best is reported)"))

    def __post_init__(self) -> None:
        counts = ("num_prompts", "max_new_tokens", "tn_max", "prompt_lookup_tokens", "repeats")
        for name in counts:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class TreeSequoiaOptions:
    acceptance: str = field(
        default="",
        **opt("acceptance vector: comma-separated p_1,p_2,... or a JSON file with an 'acceptance' list (tree measure)"),
    )
    budget: int = field(default=16, **opt("tree size n: nodes including the root"))
    max_depth: int = field(default=0, **opt("depth bound d, root = depth 1 (0 = unbounded)"))
    json: bool = field(default=False, **opt("print the tree and G(n, d) as JSON"))
    profile: str = field(
        default="",
        **opt(
            "hardware-aware sizing: a `spectot tree profile` JSON; picks (n <= --budget, d) maximising G(n,d)/(t(n)+(d-1)c)"
        ),
    )
    streams: int = field(default=1, **opt("B streams sharing each target forward (sizing with --profile)"))

    def __post_init__(self) -> None:
        if not self.acceptance:
            raise ValueError("--acceptance is required: e.g. --acceptance 0.6,0.2,0.1 or a JSON file")
        if self.streams < 1:
            raise ValueError(f"--streams must be >= 1, got {self.streams}")
        if self.streams > 1 and not self.profile:
            raise ValueError("--streams sizes the tree for B streams of a measured t(n): pass --profile with it")
        if not 1 <= self.budget <= MAX_TREE_NODES:
            raise ValueError(f"--budget must be in [1, {MAX_TREE_NODES}] (larger trees never pay), got {self.budget}")
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
    hidden_states: bool = field(
        default=True,
        **opt("EDD reads the target's hidden states; --no-hidden-states is the paper's ablation without them"),
    )
    next_token: bool = field(
        default=False,
        **opt(
            "EDD: each hidden entry also reads the token that followed it, so one layer can copy (with --init, "
            "a draft trained without it gets the input at zero weight)"
        ),
    )
    current_token: bool = field(
        default=False,
        **opt(
            "EDD: each hidden entry also reads its own token; with --next-token an entry holds both halves of a "
            "copy (with --init, a draft trained without it gets the input at zero weight)"
        ),
    )
    head_vocab: int = field(default=8192, **opt("draft head size: the corpus's most frequent tokens (q = 0 elsewhere)"))
    top_k: int = field(default=64, **opt("target probabilities kept per token for the KL loss"))
    max_len: int = field(
        default=384, **opt("tokens per corpus sequence at most (a generation: its last, features over all of it)")
    )
    block_min: int = field(default=5, **opt("shortest dual-block length L"))
    block_max: int = field(default=10, **opt("longest dual-block length L"))
    loss: Literal["kl", "ce"] = field(
        default="kl", **opt("kl: KL(P_target || P_draft); ce: cross-entropy on the target's argmax")
    )
    lr: float = field(default=1e-4, **opt("AdamW learning rate"))
    token_lr: float = field(
        default=0.0,
        **opt(
            "EDD: peak learning rate of the --current-token / --next-token input matrices (0 = --lr); they start at "
            "0 under --init, and Adam moves a weight ~lr a step, so at --lr they stay small for a whole epoch"
        ),
    )
    precision: Literal["fp32", "bf16"] = field(
        default="fp32",
        **opt(
            "training compute: fp32, or bf16 autocast over fp32 weights (several times faster with AVX512-BF16, AMX "
            "or a GPU; ~40x slower than fp32 on an AVX2-only CPU)"
        ),
    )
    batch_tokens: int = field(default=2048, **opt("padded tokens per training batch"))
    epochs: float = field(default=1.0, **opt("passes over the corpus"))
    seed: int = field(default=0, **opt("seed: data order and block lengths"))
    checkpoint_minutes: float = field(default=5.0, **opt("minutes between checkpoints"))
    resume: bool = field(default=False, **opt("continue from OUT/checkpoint.pt"))
    init: str = field(
        default="",
        **opt(
            "fine-tune: start from this draft's weights (a `train-draft` folder, or edd / vdm: the shipped ones); "
            "its layers, hidden layer and head are kept"
        ),
    )

    def __post_init__(self) -> None:
        if not self.corpus:
            raise ValueError("--corpus is required (repeatable): e.g. --corpus ../shared/data/gsm8k/train.jsonl")
        if not 1 <= self.block_min <= self.block_max:
            raise ValueError(f"need 1 <= --block-min <= --block-max, got {self.block_min}, {self.block_max}")
        if self.layers < 0 or self.head_vocab < 2 or self.top_k < 1 or self.max_len < 2:
            raise ValueError("--layers >= 0, --head-vocab >= 2, --top-k >= 1 and --max-len >= 2 are required")
        require_finite(
            lr=self.lr, token_lr=self.token_lr, epochs=self.epochs, checkpoint_minutes=self.checkpoint_minutes
        )
        if not (self.lr > 0 and self.epochs > 0 and self.batch_tokens > 0 and self.checkpoint_minutes > 0):
            raise ValueError("--lr, --epochs, --batch-tokens and --checkpoint-minutes must be positive")
        if self.token_lr < 0:
            raise ValueError(f"--token-lr must be >= 0 (0: --lr), got {self.token_lr}")
        for path in self.corpus:  # before the target loads: a typo costs seconds, not minutes
            if Path(path).is_dir():
                raise ValueError(f"--corpus {path}: is a directory, expected a JSONL file")
            if not Path(path).is_file():
                raise ValueError(f"--corpus {path}: no such file")
        if not self.resume and (Path(self.out) / "checkpoint.pt").is_file():
            raise ValueError(
                f"{self.out} holds a training checkpoint: pass --resume to continue it, or choose another --out"
            )
        if (self.next_token or self.current_token) and (self.kind != "edd" or not self.hidden_states):
            raise ValueError(
                "--next-token and --current-token pair the target's hidden states with tokens: they need --kind edd "
                "with them"
            )
        if self.kind == "vdm":
            _refuse_unread(
                _set(self, "hidden_layer", "hidden_states", "token_lr"),
                "configure EDD's hidden-state input; --kind vdm (no hidden states)",
            )
        elif self.token_lr and not (self.next_token or self.current_token or self.init):  # --init: its draft's
            raise ValueError("--token-lr is the learning rate of --next-token / --current-token's inputs: pass one")


@dataclass(frozen=True)
class TreeMeasureOptions:
    prompts: str = field(default="../shared/data/gsm8k/test.jsonl", **opt("JSONL prompts"))
    field_name: str = field(default="question", **opt("JSON field holding the prompt", flag="--field"))
    offset: int = field(
        default=100, **opt("skip the first N prompts (keep measurement prompts apart from benchmark ones)")
    )
    limit: int = field(default=8, **opt("prompts to decode"))
    width: int = field(default=8, **opt("W: candidates below the pending token; the vector has W entries"))
    temperature: float = field(default=0.0, **opt("sampling temperature (0 = greedy)"))
    max_new_tokens: int = field(default=128, **opt("tokens per prompt"))
    out: str = field(default="", **opt("write the JSON here too (default: print only)"))

    def __post_init__(self) -> None:
        if self.out:
            writable_file(self.out, "--out")
        if self.width < 1 or self.limit < 1 or self.offset < 0 or self.max_new_tokens < 1:
            raise ValueError("--width, --limit and --max-new-tokens must be >= 1, --offset >= 0")
        require_finite(temperature=self.temperature)
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")


@dataclass(frozen=True)
class TreeProfileOptions:
    tn_max: int = field(default=64, **opt("largest n of the t(n) curve"))
    depths: int = field(default=8, **opt("draft chain depth used to time one draft step"))
    out: str = field(default="", **opt("write the JSON here too (default: print only)"))

    def __post_init__(self) -> None:
        if self.out:
            writable_file(self.out, "--out")
        if self.tn_max < 1 or self.depths < 2:
            raise ValueError(f"--tn-max must be >= 1 and --depths >= 2, got {self.tn_max}, {self.depths}")


TRAINED_DRAFT_DEFAULTS = {"draft": "edd"}  # DraftOptions of bench trees, tree measure / profile: the n-gram has no q


@dataclass(frozen=True)
class BenchTreesOptions:
    gsm8k: str = field(default="../shared/data/gsm8k/test.jsonl", **opt("GSM8K JSONL (field 'question')"))
    creative_writing: str = field(
        default="../shared/data/tot_creative_writing/data_100_random_text.txt", **opt("ToT Creative Writing inputs")
    )
    gsm8k_prompts: int = field(default=8, **opt("first N GSM8K test questions"))
    cw_prompts: int = field(default=4, **opt("Creative Writing inputs, from --cw-offset (0: none)"))
    cw_offset: int = field(
        default=60, **opt("skip the first N Creative Writing lines (spectot's drafts trained on lines 1-60)")
    )
    measure_prompts: int = field(
        default=6, **opt("GSM8K questions after the benchmark ones, for the acceptance vectors")
    )
    measure_width: int = field(default=8, **opt("star-tree width for the acceptance vectors"))
    max_new_tokens: int = field(default=96, **opt("tokens per prompt"))
    temperatures: str = field(default="0,0.6", **opt("comma-separated temperatures (0 = greedy)"))
    chain_k: int = field(default=5, **opt("draft tokens of the chain baseline"))
    sequoia_max_nodes: int = field(default=64, **opt("largest tree the hardware-aware sizing considers"))
    sequoia_max_depth: int = field(default=10, **opt("deepest tree the hardware-aware sizing considers"))
    sequoia_fixed: int = field(
        default=41, **opt("also run Sequoia at this size (41 = SpecInfer 5x8's nodes incl. root)")
    )
    eagle2_tokens: int = field(default=24, **opt("EAGLE-2 tokens kept after reranking"))
    tn_max: int = field(default=64, **opt("largest n of the t(n) curve"))
    out: str = field(default="runs/bench_trees", **opt("output folder (JSON, Markdown, PNG)"))

    def __post_init__(self) -> None:
        if min(self.gsm8k_prompts, self.cw_prompts, self.cw_offset, self.measure_prompts) < 0:
            raise ValueError("--gsm8k-prompts, --cw-prompts, --cw-offset and --measure-prompts must be >= 0")
        if self.gsm8k_prompts + self.cw_prompts == 0 or self.measure_prompts == 0:
            raise ValueError("bench trees needs prompts to time and --measure-prompts to measure acceptance")
        sizes = ("measure_width", "max_new_tokens", "chain_k", "sequoia_max_nodes", "sequoia_max_depth")
        for name in (*sizes, "sequoia_fixed", "eagle2_tokens", "tn_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        parse_temperatures(self.temperatures, "--temperatures")


@dataclass(frozen=True)
class BenchDraftsOptions:
    gsm8k: str = field(
        default="../shared/data/gsm8k/test.jsonl", **opt("GSM8K JSONL (field 'question'); drafts train on train.jsonl")
    )
    creative_writing: str = field(
        default="../shared/data/tot_creative_writing/data_100_random_text.txt", **opt("ToT Creative Writing inputs")
    )
    gsm8k_offset: int = field(default=0, **opt("skip the first N GSM8K questions"))
    gsm8k_prompts: int = field(default=8, **opt("GSM8K questions (0: none)"))
    cw_prompts: int = field(default=4, **opt("Creative Writing inputs, from --cw-offset (0: none)"))
    cw_offset: int = field(
        default=60, **opt("skip the first N Creative Writing lines (spectot's drafts trained on lines 1-60)")
    )
    max_new_tokens: int = field(default=128, **opt("tokens per prompt"))
    k: int = field(default=5, **opt("draft tokens per step of the chain drafts"))
    edd: str = field(default="edd", **opt("the EDD draft (alias or folder)"))
    vdm: str = field(default="vdm", **opt("the VDM draft (alias or folder)"))
    pct_threshold: float = field(default=0.1, **opt("PCT expansion threshold s_d / s_t for EDD + PCT"))
    lookup: int = field(
        default=2,
        **opt(
            "rows EDD + lookup and EDD + PCT + lookup graft the prompt-lookup match of >= N tokens (0: no such rows)"
        ),
    )
    ablation: tuple[str, ...] = field(
        default=(),
        **opt(
            "extra draft row NAME=DRAFT[,FIELD=VALUE...] (repeatable): DRAFT an alias or folder, a k-token chain "
            "unless FIELDs (draft options, e.g. tree=pct,draft_head=2048) say otherwise; e.g. no-hidden=runs/edd-nohidden",
            action="append",
        ),
    )
    methods: str = field(
        default="",
        **opt("comma-separated rows to run, e.g. ar,edd,edd+pct ('' = all; ar and --ablation rows always run)"),
    )
    out: str = field(default="runs/bench_drafts", **opt("output folder (JSON, Markdown)"))

    def __post_init__(self) -> None:
        if self.gsm8k_prompts < 0 or self.cw_prompts < 0:
            raise ValueError("--gsm8k-prompts and --cw-prompts count prompts: they must be >= 0")
        if self.gsm8k_prompts + self.cw_prompts == 0:
            raise ValueError("bench drafts needs prompts: --gsm8k-prompts or --cw-prompts above 0")
        if self.gsm8k_offset < 0 or self.cw_offset < 0 or self.lookup < 0:
            raise ValueError("--gsm8k-offset, --cw-offset and --lookup must be >= 0")
        if self.k < 1 or self.max_new_tokens < 1:
            raise ValueError(f"--k and --max-new-tokens must be >= 1, got {self.k}, {self.max_new_tokens}")
        if not 0 <= self.pct_threshold < 1:
            raise ValueError(f"--pct-threshold must be in [0, 1), got {self.pct_threshold}")


TaskName = Literal["gsm8k", "creative_writing", "blocksworld", "math500"]
EngineName = Literal[
    "ar",
    "sd",
    "mcsd",
    "batched-ar",
    "hf-batched-ar",
    "batched-sd",
    "seed",
    "seed-batched",
    "continuous-ar",
    "continuous-sd",
]
SearchName = Literal["tot-bfs", "rebase", "ets", "rstar", "rest-mcts"]
TREE_SEARCHES = ("rebase", "ets", "rstar", "rest-mcts")  # over an async backend, with SPEX


@dataclass(frozen=True)
class ThoughtSampling:
    """How a search samples its thoughts and evaluations (every search: ToT-BFS, REBASE, ETS, the MCTS ones)."""

    thought_temperature: float = field(default=1.0, **opt("sampling temperature of thoughts (0 = greedy)"))
    thought_top_p: float = field(default=1.0, **opt("nucleus mass of thought sampling (1 = off)"))
    eval_temperature: float = field(default=0.0, **opt("sampling temperature of evaluations (0 = greedy)"))

    def __post_init__(self) -> None:
        require_finite(thought_temperature=self.thought_temperature, eval_temperature=self.eval_temperature)
        if not (self.thought_temperature >= 0 and self.eval_temperature >= 0):
            raise ValueError("--thought-temperature and --eval-temperature must be >= 0")
        if not 0 < self.thought_top_p <= 1:
            raise ValueError(f"--thought-top-p must be in (0, 1], got {self.thought_top_p}")
        if self.thought_temperature == 0 and self.thought_top_p < 1:
            raise ValueError(
                f"--thought-top-p {self.thought_top_p} truncates sampling; --thought-temperature 0 decodes greedily "
                "(the argmax lies in every nucleus): sample (--thought-temperature > 0) or drop --thought-top-p"
            )


@dataclass(frozen=True)
class SearchOptions(ThoughtSampling):
    search: SearchName = field(
        default="tot-bfs",
        **opt(
            "search algorithm: tot-bfs (Tree-of-Thoughts BFS, level engines), rebase / ets (reward-balanced BFS), "
            "rstar / rest-mcts (MCTS); the last four run over an async backend (--backend)"
        ),
    )
    breadth: int = field(default=1, **opt("b: states kept per level"))
    thoughts: int = field(default=3, **opt("n: thoughts generated per state"))
    generation: Literal["sample", "propose"] = field(
        default="sample", **opt("G: sample n thoughts independently, or propose n in one output")
    )
    evaluation: Literal["value", "vote"] = field(
        default="value", **opt("E: value each new state, or vote among the siblings")
    )
    n_votes: int = field(default=3, **opt("votes per level (--evaluation vote)"))
    depth: int = field(default=0, **opt("T: search steps (0 = the task's depth)"))
    seed: int = field(default=0, **opt("random seed: a run is a pure function of it (whatever the engine)"))

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("breadth", "thoughts", "n_votes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.depth < 0:
            raise ValueError(f"--depth must be >= 0, got {self.depth}")


@dataclass(frozen=True)
class SolveOptions:
    task: TaskName = field(default="gsm8k", **opt("reasoning task"))
    data: str = field(
        default="",
        **opt(
            "the task's data file (GSM8K/MATH-500 jsonl, ToT text, Blocksworld json/jsonl); empty = "
            "the built-in examples"
        ),
    )
    limit: int = field(default=3, **opt("problems to solve (0 = all)"))
    offset: int = field(default=0, **opt("skip the first N problems"))
    engine: EngineName = field(
        default="seed-batched",
        **opt(
            "how a level's n generations run: ar / sd / mcsd serially, batched-ar / batched-sd all streams in one "
            "forward, hf-batched-ar (transformers generate() on the padded level), seed (SEED's rounds), "
            "seed-batched (SEED + one forward for all queued trees), continuous-ar / continuous-sd (the continuous "
            "engine: each thought's evaluation starts as soon as the thought ends, beside the level's other streams)"
        ),
    )
    prompt_pool: str = field(default="", **opt("Blocksworld: RAP prompt pool json (empty = built-in demos)"))
    profile: str = field(
        default="", **opt("JSON of `spectot tree profile` (t(n), c) for tree sizing; empty = measure at start")
    )
    json: str = field(default="", **opt("write one JSON line per problem (tree, answer, stats) to this file"))
    resume: bool = field(
        default=False,
        **opt(
            "continue the --json file an interrupted run of the same command wrote: its problems are not run "
            "again (refused if the flags differ)"
        ),
    )
    trace: str = field(default="", **opt("write the per-stream timeline here (draw it with `spectot trace`)"))
    generations: str = field(
        default="",
        **opt(
            "write every generation (prompt_ids, token_ids, TG / SE) as JSONL here: the target's own thoughts, "
            "a `spectot train-draft --corpus`"
        ),
    )

    def __post_init__(self) -> None:
        if self.limit < 0 or self.offset < 0:
            raise ValueError("--limit and --offset must be >= 0")
        if self.resume and not self.json:
            raise ValueError("--resume continues a --json file: pass the --json of the run to continue")
        if self.resume and self.generations:
            raise ValueError("--resume continues --json only: write --generations in a run of its own")
        if self.json:
            (writable_file if self.resume else fresh_output)(self.json, "--json")
        if self.generations:
            fresh_output(self.generations, "--generations")
        if self.trace:
            writable_file(self.trace, "--trace")


@dataclass(frozen=True)
class TreeSearchOptions:
    """REBASE / ETS / rStar / REST-MCTS and SPEX (used when --search is not tot-bfs, but for --queries-in-flight)."""

    budget: int = field(default=4, **opt("REBASE / ETS: width B per depth; MCTS: rollouts"))
    balance_temperature: float = field(default=0.2, **opt("T_b of REBASE's softmax over rewards"))
    max_children: int = field(default=3, **opt("MCTS: children a node may get"))
    rest_children: int = field(default=2, **opt("REST-MCTS: children each step expands (the best is kept)"))
    rest_alpha: float = field(
        default=0.5,
        **opt("REST-MCTS*: a rollout's value, (1 - alpha) r_first + alpha max of the later steps' process rewards"),
    )
    lambda_kv: float = field(default=1.0, **opt("ETS: weight of the KV cost of retained nodes"))
    lambda_cov: float = field(default=1.4, **opt("ETS: weight of semantic coverage"))
    ets_embedder: str = field(
        default="",
        **opt(
            "ETS: a sentence-embedding model (alias, folder or hub id; mean-pooled last layer) whose cosine "
            "distances cluster the steps, as the paper; empty: TF-IDF of character trigrams"
        ),
    )
    cluster_threshold: float | None = field(
        default=None,
        **opt(
            "ETS: cosine distance under which steps share a cluster (default 0.05 with --ets-embedder, the "
            "paper's; 0.6 for trigrams)"
        ),
    )
    reward: Literal["self_eval", "logprob"] = field(
        default="self_eval", **opt("reward of a new state: the task's self-evaluation prompt, or exp(mean logprob)")
    )
    explore: Literal["none", "spex"] = field(default="none", **opt("SPEX speculative exploration on or off"))
    k_total: int = field(
        default=8, **opt("SPEX: expansions in flight over all queries, primary + speculative (bench spex measures it)")
    )
    lookahead: int = field(default=2, **opt("SPEX BFS: layers expanded ahead"))
    tau: float = field(
        default=1.0,
        **opt("SPEX: softmax temperature of the inter-query budget, k_q ~ softmax(tau score)_q (0: an even split)"),
    )
    budget_wakeup: bool = field(
        default=False,
        **opt(
            "SPEX: a query refused speculation asks again as soon as any query's expansion ends (off: only when one "
            "of its own ends; on this 2-core CPU at 4 queries in flight it speculated more and gained nothing)"
        ),
    )
    retract: bool = field(
        default=True,
        **opt(
            "SPEX BFS: cancel a running speculated child as soon as its level's latest widths no longer predict it "
            "(a finished one is kept); off: it runs until the level is decided"
        ),
    )
    fill_rows: int = field(
        default=0,
        **opt(
            "SPEX, local engine: forward rows a speculative prompt may fill in chunks beside primary decoding, so "
            "it never stalls it (0: prefilled at once, as a primary prompt: faster on the reference CPU, where "
            "speculative prompts filled 4-8 rows a step arrived late)"
        ),
    )
    sd_requests: Literal["primary", "next", "all"] = field(
        default="primary",
        **opt(
            "SPEX + SD, local engine: the requests the draft drafts for: primary ones, + the likeliest pre-run's "
            "(MCTS exact), or every speculative one too; the others decode autoregressively, to the same tokens "
            "(with a deterministic draft; a sampling draft keeps the distribution only)"
        ),
    )
    dfs_speculation: Literal["exact", "fold"] = field(
        default="exact",
        **opt(
            "SPEX MCTS: exact pre-runs the rollouts the search is predicted to select next (its tree and answers "
            "stay the plain search's); fold folds extra virtual-loss rollouts in as simulations (the paper's)"
        ),
    )
    early_stop: bool = field(default=False, **opt("stop a query once the weighted vote is settled (SPEX)"))
    min_answers: int = field(default=4, **opt("early stop: answers needed first (t)"))
    alpha: float = field(default=0.5, **opt("early stop: margin alpha in conf1 - conf2 > alpha avg(w2)"))
    queries_in_flight: int = field(
        default=1,
        **opt(
            "queries searched concurrently (their requests share forwards); tot-bfs: with a continuous engine "
            "(continuous-ar, continuous-sd)"
        ),
    )

    def __post_init__(self) -> None:
        for name in ("budget", "max_children", "rest_children", "queries_in_flight", "min_answers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        require_finite(
            balance_temperature=self.balance_temperature,
            lambda_kv=self.lambda_kv,
            lambda_cov=self.lambda_cov,
            alpha=self.alpha,
            tau=self.tau,
            rest_alpha=self.rest_alpha,
        )
        if not 0 <= self.rest_alpha <= 1:
            raise ValueError(f"--rest-alpha weighs two values and must lie in [0, 1], got {self.rest_alpha}")
        if self.tau < 0:
            raise ValueError(f"--tau must be >= 0 (a negative tau favours the worst queries), got {self.tau}")
        if self.k_total < 0 or self.lookahead < 0 or self.fill_rows < 0 or self.balance_temperature <= 0:
            raise ValueError("--k-total, --lookahead and --fill-rows must be >= 0, --balance-temperature > 0")
        if self.lambda_kv < 0 or self.lambda_cov < 0 or self.alpha < 0:
            raise ValueError("--lambda-kv, --lambda-cov and --alpha must be >= 0")
        if self.cluster_threshold is not None and not 0 <= self.cluster_threshold <= 2:
            raise ValueError(
                f"--cluster-threshold is a cosine distance: a number in [0, 2] (2 puts every step in one cluster), "
                f"got {self.cluster_threshold}"
            )

    @property
    def threshold(self) -> float:
        """ETS's cluster cut for the representation in use."""
        if self.cluster_threshold is not None:
            return self.cluster_threshold
        return 0.05 if self.ets_embedder else 0.6


@dataclass(frozen=True)
class BackendOptions:
    backend: Literal["local", "openai"] = field(
        default="local", **opt("local: spectot's engine in-process; openai: OpenAI-compatible servers (--base-url)")
    )
    base_url: tuple[str, ...] = field(
        default=(),
        **opt("an OpenAI-compatible server, e.g. http://host:8000/v1 (repeat to load-balance)", action="append"),
    )
    served_model: str = field(default="", **opt("model name on the servers (empty = the first in /v1/models)"))
    timeout: float = field(default=120.0, **opt("seconds per HTTP request"))
    connect_timeout: float = field(
        default=10.0, **opt("seconds to connect to a server before passing the request on to another")
    )
    retries: int = field(default=3, **opt("retries with backoff on connection errors, 429 and 5xx"))
    method: Literal["ar", "sd"] = field(default="ar", **opt("local engine: plain decoding or speculative (--draft)"))
    max_streams: int = field(default=64, **opt("local engine: most requests decoded together"))

    def __post_init__(self) -> None:
        if self.backend == "openai" and not self.base_url:
            raise ValueError("--backend openai needs at least one --base-url (e.g. http://localhost:8000/v1)")
        if self.base_url:
            from spectot.backends.openai import check_server_url

            for url in self.base_url:
                check_server_url(url, "--base-url")
        require_finite(timeout=self.timeout, connect_timeout=self.connect_timeout)
        if self.max_streams < 1 or self.retries < 0 or self.timeout <= 0 or self.connect_timeout <= 0:
            raise ValueError("--max-streams must be >= 1, --retries >= 0, --timeout and --connect-timeout > 0")


@dataclass(frozen=True)
class ServeOptions:
    host: str = field(default="127.0.0.1", **opt("address to listen on"))
    port: int = field(default=8000, **opt("port to listen on"))
    method: Literal["ar", "sd"] = field(default="ar", **opt("plain decoding or speculative (needs --draft)"))
    max_streams: int = field(default=64, **opt("most requests decoded together"))
    max_choices: int = field(
        default=256, **opt("most completions one HTTP request may ask for (its prompts x n; more is a 400)")
    )
    max_body_mb: float = field(default=32.0, **opt("largest request body in MB (more is a 413)"))
    shutdown_grace: float = field(
        default=5.0,
        **opt("seconds in-flight requests may run on after a shutdown signal; then each is answered 503"),
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0-65535 (0: any free port), got {self.port}")
        if self.max_streams < 1:
            raise ValueError(f"--max-streams must be >= 1, got {self.max_streams}")
        if self.max_choices < 1:
            raise ValueError(f"--max-choices must be >= 1, got {self.max_choices}")
        if not (math.isfinite(self.max_body_mb) and self.max_body_mb > 0):
            raise ValueError(f"--max-body-mb must be a number > 0, got {self.max_body_mb}")
        require_finite(shutdown_grace=self.shutdown_grace)
        if not self.shutdown_grace >= 0:
            raise ValueError(f"--shutdown-grace must be >= 0 seconds, got {self.shutdown_grace}")


SPEX_VARIANTS = {  # bench spex's cells: variant -> (exploration, decoding method, early termination)
    "plain": ("none", "ar", False),
    "spex": ("spex", "ar", False),
    "spex+wake": ("spex", "ar", False),  # with the budget wake-up (``--budget-wakeup``)
    "sd": ("none", "sd", False),
    "spex+sd": ("spex", "sd", False),
    "spex+es": ("spex", "ar", True),
    "spex+sd+es": ("spex", "sd", True),
}


@dataclass(frozen=True)
class BenchSpexOptions:
    gsm8k: str = field(default="../shared/data/gsm8k/test.jsonl", **opt("GSM8K test jsonl ('' = skip)"))
    math500: str = field(default="../shared/data/math500/test.jsonl", **opt("MATH-500 jsonl ('' = skip)"))
    problems: int = field(default=40, **opt("questions per task"))
    searches: str = field(default="rebase,rstar", **opt("comma-separated searches"))
    in_flight: str = field(default="1,4,8", **opt("comma-separated queries in flight"))
    variants: str = field(
        default="plain,spex,sd,spex+sd",
        **opt(
            "comma-separated: plain, spex, sd, spex+sd, spex+es, spex+sd+es (es: early termination), spex+wake "
            "(spex with the budget wake-up, --budget-wakeup)"
        ),
    )
    remote: bool = field(default=True, **opt("also run once through `spectot serve` + the OpenAI backend"))
    chunk: int = field(
        default=10,
        **opt(
            "questions a variant runs before the next variant runs the same ones (at least 2 x queries in "
            "flight): the variants take turns, so the machine's drift hits each alike; 0 = whole cells"
        ),
    )
    fixed_k_total: int = field(
        default=0, **opt("SPEX's k_total for every cell instead of the one measured from the engine's throughput (0)")
    )
    out: str = field(default="runs/bench_spex", **opt("output folder (JSON, Markdown, records for resuming)"))

    def __post_init__(self) -> None:
        if self.fixed_k_total < 0:
            raise ValueError(f"--fixed-k-total must be >= 0 (0: measure it), got {self.fixed_k_total}")
        if self.chunk < 0 or self.problems < 1:
            raise ValueError(
                f"need --chunk >= 0 (0: whole cells) and --problems >= 1, got {self.chunk}, {self.problems}"
            )
        parse_names(self.searches, "--searches", TREE_SEARCHES)
        parse_int_list(self.in_flight, "--in-flight")
        parse_names(self.variants, "--variants", tuple(SPEX_VARIANTS))  # before the output folder is made
        if not (self.gsm8k or self.math500):  # it measured throughput and wrote an empty table, exit 0
            raise ValueError("--gsm8k and --math500 are both empty: give at least one question file")


@dataclass(frozen=True)
class TraceOptions:
    file: str = field(default="", **opt("timeline JSON written by `spectot solve --trace`", positional=True))
    out: str = field(default="trace.png", **opt("Gantt chart to write: .png, .pdf or .svg"))
    title: str = field(default="", **opt("chart title"))

    def __post_init__(self) -> None:
        writable_file(self.out, "--out")
        if Path(self.out).suffix.lower() not in (".png", ".pdf", ".svg"):
            raise ValueError(f"--out {self.out!r}: name the chart .png, .pdf or .svg (its suffix picks the format)")


@dataclass(frozen=True)
class BenchTotOptions:
    tasks: str = field(
        default="gsm8k",
        **opt("comma-separated tasks: gsm8k, creative_writing, blocksworld, math500 (its built-in examples)"),
    )
    gsm8k: str = field(default="../shared/data/gsm8k/test.jsonl", **opt("GSM8K test jsonl"))
    creative_writing: str = field(
        default="../shared/data/tot_creative_writing/data_100_random_text.txt", **opt("ToT Creative Writing text")
    )
    blocksworld: str = field(
        default="../shared/data/blocksworld/split_v1_step_6_rendered.jsonl", **opt("Blocksworld rendered jsonl")
    )
    prompt_pool: str = field(default="../shared/data/blocksworld/prompts/pool_prompt_v1.json", **opt("RAP pool"))
    problems: int = field(default=10, **opt("problems per task"))
    engines: str = field(
        default="all",
        **opt(
            "comma-separated engines to compare; all: every engine --draft runs (the drafting ones with a draft, "
            "mcsd with a draft decoder)"
        ),
    )
    in_flight: int = field(
        default=1, **opt("problems the continuous engines search at once (their wall time is shared; others: 1)")
    )
    chunk: int = field(
        default=5,
        **opt(
            "problems an engine runs before the next engine runs the same ones (rounded up to a multiple of "
            "--in-flight): the engines take turns, so the machine's drift hits each alike; 0 = whole cells"
        ),
    )
    out: str = field(default="runs/bench_tot", **opt("output folder (JSON, Markdown, records for resuming)"))

    def __post_init__(self) -> None:
        if self.problems < 1 or self.in_flight < 1:
            raise ValueError("--problems and --in-flight must be >= 1")
        if self.chunk < 0:
            raise ValueError(f"--chunk counts problems (0: whole cells), got {self.chunk}")
        parse_names(self.tasks, "--tasks", get_args(TaskName))
        if self.engines != "all":
            parse_names(self.engines, "--engines", get_args(EngineName))

    @property
    def turn(self) -> int:
        """Problems an engine runs per turn: --chunk rounded up to a multiple of --in-flight (all: 0)."""
        if not self.chunk:
            return self.problems
        return -(-self.chunk // self.in_flight) * self.in_flight

    def engine_names(self, draft: str) -> list[str]:
        """The engines to run with ``--draft draft``, each checked against it (``check_engine_draft``)."""
        if self.engines == "all":
            return [e for e in get_args(EngineName) if engine_draft_problem(e, draft) is None]
        engines = [e.strip() for e in self.engines.split(",") if e.strip()]
        for engine in engines:
            check_engine_draft(engine, draft)
        return engines


DRAFTLESS_ENGINES = ("ar", "batched-ar", "hf-batched-ar", "continuous-ar")


def is_draft_decoder(draft: str) -> bool:
    """Whether ``--draft`` names one of spectot's draft decoders (edd, vdm, a `spectot train-draft` folder): the drafts
    that grow trees (a plain draft model drafts a chain)."""
    return draft in ("edd", "vdm") or (Path(draft).expanduser() / "draft.json").is_file()


def check_draft(draft: DraftOptions) -> None:
    """Draft flags a user gave that would be ignored (engines set a tree on any draft; only a model uses it), and
    a --draft that names nothing, refused before the target loads."""
    from spectot.models.loader import looks_like_hub_id
    from spectot.models.registry import find_alias

    named = draft.draft in ("none", "ngram", "edd", "vdm") or find_alias(draft.draft) is not None
    if not (named or Path(draft.draft).expanduser().exists() or looks_like_hub_id(draft.draft)):
        raise ValueError(
            f"--draft {draft.draft}: not a draft; use none, ngram, edd, vdm, a `spectot train-draft` folder, or a "
            "model (alias, checkpoint folder or hub id org/name) sharing the target's tokenizer"
        )
    if draft.tree not in ("auto", "chain") and draft.draft in ("none", "ngram"):
        raise ValueError(
            f"--tree {draft.tree} shapes a draft model's tree; --draft {draft.draft} has none (--ngram-width widens "
            "the n-gram draft)"
        )
    if draft.tree != "auto":  # an auto tree is the engine's own, which may read any of them
        shapes = {
            "k_config": ("k_config",),
            "specinfer": ("specinfer",),
            "pct_threshold": ("pct",),
            "tree_budget": ("sequoia", "eagle2"),
            "tree_depth": ("sequoia", "pct", "vct", "cape", "eagle2"),
        }
        unread = [flag for flag in shapes if draft.tree not in shapes[flag]]
        _refuse_unread(_set(draft, *unread), f"shape other trees; --tree {draft.tree}")
    if draft.tree not in ("auto", "chain") and not is_draft_decoder(draft.draft):
        raise ValueError(
            f"--tree {draft.tree} shapes the trees of spectot's draft decoders (edd, vdm, a `spectot train-draft` "
            f"folder); the draft model {draft.draft} drafts a chain"
        )


def engine_draft_problem(engine: str, draft: str) -> str | None:
    """Why ``engine`` cannot run with ``--draft draft`` (None: it can): a level engine that drafts needs a draft,
    and ``mcsd`` one that drafts trees (its k_config)."""
    if engine not in DRAFTLESS_ENGINES and draft == "none":
        return (
            f"--engine {engine} drafts: pass --draft ngram, edd, vdm or a draft model, or pick an engine without "
            f"one ({', '.join(DRAFTLESS_ENGINES)})"
        )
    if engine == "mcsd" and draft != "none" and not is_draft_decoder(draft):
        return (
            f"--engine mcsd verifies k_config trees of a draft decoder (edd, vdm, a `spectot train-draft` folder); "
            f"--draft {draft} grows none: use --engine sd"
        )
    return None


def check_engine_draft(engine: str, draft: str) -> None:
    """``engine_draft_problem`` as a ValueError, before the target loads (``make_engine`` would fail after it, or
    run ``mcsd`` as chain SD under its name)."""
    problem = engine_draft_problem(engine, draft)
    if problem is not None:
        raise ValueError(problem)


def check_solve(
    search: SearchOptions,
    draft: DraftOptions,
    options: SolveOptions,
    tree: TreeSearchOptions,
    backend: BackendOptions,
    model: ModelOptions | None = None,
) -> None:
    """The combinations of `spectot solve` flags that no one options class sees, refused before a model loads
    (each would otherwise be ignored in silence or fail after minutes)."""
    if search.search != "ets" and (tree.ets_embedder or tree.cluster_threshold is not None):
        raise ValueError("--ets-embedder and --cluster-threshold cluster ETS's steps: use them with --search ets")
    if search.search == "tot-bfs":
        _refuse_unread(
            _set(tree, *TREE_SEARCH_FLAGS, "early_stop", "min_answers", "alpha")
            + _set(backend, "method", "max_streams", "served_model", "timeout", "connect_timeout", "retries"),
            "configure the tree searches (--search rebase, ets, rstar, rest-mcts); --search tot-bfs",
        )
        if search.evaluation == "value":
            _refuse_unread(_set(search, "n_votes"), "counts --evaluation vote's votes; --evaluation value")
        check_generation(options.task, search.generation)
        if search.evaluation == "vote" and search.n_votes > 1 and search.eval_temperature == 0:
            raise ValueError(
                f"--evaluation vote --n-votes {search.n_votes} at --eval-temperature 0 casts {search.n_votes} "
                "identical votes: sample them (--eval-temperature 0.7, as ToT) or pass --n-votes 1"
            )
        if options.engine in DRAFTLESS_ENGINES and draft.draft not in ("none", "ngram"):
            raise ValueError(
                f"--engine {options.engine} decodes without a draft, so --draft {draft.draft} would be unused: "
                "pick a drafting engine (sd, mcsd, batched-sd, seed, seed-batched, continuous-sd)"
            )
        if options.engine in DRAFTLESS_ENGINES:
            _refuse_unread(_shaping_set(draft), f"shape speculative decoding; --engine {options.engine}")
        else:
            check_draft_kind(draft)
        if backend.backend != "local" or backend.base_url:
            raise ValueError(
                "--backend openai / --base-url serve the tree searches (--search rebase, ets, rstar, rest-mcts); "
                "--search tot-bfs runs on the local level engines (--engine)"
            )
        if tree.explore != "none":
            raise ValueError("--explore spex speculates for --search rebase, ets, rstar or rest-mcts, not tot-bfs")
        check_engine_draft(options.engine, draft.draft)
        if options.trace and options.engine.startswith("continuous"):  # it wrote an empty trace
            raise ValueError(
                f"--trace records per-stream timelines of the level engines; --engine {options.engine} keeps none "
                "(its streams join and leave one shared step): trace ar, sd, mcsd, batched-* or seed*"
            )
        if tree.queries_in_flight > 1 and not options.engine.startswith("continuous"):
            raise ValueError(
                f"--queries-in-flight {tree.queries_in_flight} with --search tot-bfs needs a continuous engine "
                f"(continuous-ar, continuous-sd): '{options.engine}' runs one level at a time"
            )
        return
    if options.generations:
        raise ValueError(f"--generations records --search tot-bfs runs; --search {search.search} does not write it")
    mcts = search.search in ("rstar", "rest-mcts")
    _refuse_unread(
        _set(search, "breadth", "thoughts", "generation", "evaluation", "n_votes")
        + _set(options, "engine", "trace", "profile"),
        f"configure --search tot-bfs (the tree searches run on --backend local --method ar|sd, or servers); "
        f"--search {search.search}",
    )
    foreign = ("balance_temperature", "lambda_kv", "lambda_cov", "lookahead", "retract") if mcts else ()
    foreign += () if mcts else ("max_children", "dfs_speculation")
    foreign += () if search.search == "rest-mcts" else ("rest_children", "rest_alpha")
    _refuse_unread(_set(tree, *foreign), f"belong to another search algorithm; --search {search.search}")
    if tree.explore == "none":
        _refuse_unread(
            _set(
                tree,
                "k_total",
                "lookahead",
                "tau",
                "retract",
                "fill_rows",
                "sd_requests",
                "dfs_speculation",
                "budget_wakeup",
            ),
            "configure SPEX's speculation; without --explore spex the search",
        )
    if backend.backend == "openai" and options.resume and not backend.served_model:
        raise ValueError(
            "--resume against servers needs --served-model: the records must say which model wrote them (servers "
            "serve what they loaded, so another server or a reload would mix two models' records)"
        )
    if backend.backend == "local":
        _refuse_unread(
            _set(backend, "base_url", "served_model", "timeout", "connect_timeout", "retries"),
            "configure --backend openai; the local backend",
        )
        check_method(backend.method, draft)
    else:
        if model is not None and _set(model, "target"):
            raise ValueError(
                "--target names the local model; --backend openai asks the servers for --served-model (default: "
                "the first model they list)"
            )
        _refuse_unread(
            _set(backend, "method", "max_streams")
            + _set(tree, "fill_rows", "sd_requests")
            + (["--draft"] if draft.draft not in ("none", "ngram") else [])
            + _shaping_set(draft)
            + (_set(model, "dtype", "kernels", "prefix_cache", "chat_template") if model is not None else []),
            "configure the local engine; --backend openai (the servers decode as they are set up)",
        )
    if backend.backend == "local" and backend.method == "sd" and draft.draft == "none":
        raise ValueError("--method sd decodes with a draft: pass --draft ngram, edd, vdm or a draft model")


def check_method(method: str, draft: DraftOptions) -> None:
    """--method ar decodes without a draft: a draft or draft flags given with it (serve and generate once ran plain
    decoding under them in silence) are refused."""
    if method != "ar":
        check_draft_kind(draft)
        return
    if draft.draft not in ("none", "ngram"):
        raise ValueError(f"--draft {draft.draft} drafts for --method sd; with --method ar it would be unused")
    _refuse_unread(_shaping_set(draft), "shape speculative decoding (--method sd); --method ar")


def check_tree_tool(command: str, draft: DraftOptions) -> None:
    """`tree measure` drafts a star of --width and `tree profile` a chain, whatever the shaping flags say: given, they
    were overridden in silence."""
    shaping = ("tree", "k_config", "specinfer", "tree_budget", "tree_depth", "acceptance", "pct_threshold")
    _refuse_set(
        _set(draft, *shaping, "adaptive_k", "lookup", "num_draft_tokens"),
        f"tree {command} drafts a shape of its own ({'a star of --width' if command == 'measure' else 'chains'})",
    )


NGRAM_FLAGS = ("ngram_max", "ngram_min", "ngram_width")  # read by the n-gram draft only
DRAFT_DECODER_FLAGS = ("draft_head", "lookup", "coupled", "tree_children", "draft_width")  # by edd / vdm / trained


def check_draft_kind(draft: DraftOptions) -> None:
    """Flags of another kind of draft than --draft's, refused (the n-gram draft ran with --draft-head, a trained
    draft with --ngram-max, in silence)."""
    if draft.draft == "none":
        return
    if draft.draft != "ngram":
        _refuse_unread(_set(draft, *NGRAM_FLAGS), f"configure the n-gram draft; --draft {draft.draft}")
    if not is_draft_decoder(draft.draft):
        _refuse_unread(
            _set(draft, *DRAFT_DECODER_FLAGS),
            f"configure spectot's trained drafts (edd, vdm, a train-draft folder); --draft {draft.draft}",
        )


def check_generation(task: str, generation: str) -> None:
    """``--generation propose`` where the task's steps are no one-line proposals, refused before the model loads."""
    if generation == "propose" and task == "creative_writing":
        raise ValueError(
            "--generation propose lists one-line steps; Creative Writing's plans and passages are paragraphs: "
            "sample them (--generation sample)"
        )


def check_bench(bench: str, draft: DraftOptions, search: SearchOptions | None, tree: TreeSearchOptions | None) -> None:
    """The flags a benchmark sets itself (per method, per variant), refused when given (they were overridden in
    silence), and drafts it cannot measure, before any model loads."""
    if bench == "trees":
        _refuse_set(
            _set(draft, "tree", "k_config", "acceptance", "num_draft_tokens"),
            "bench trees sets them for each of its methods (--chain-k, --sequoia-*, --eagle2-tokens size them)",
        )
        if not is_draft_decoder(draft.draft):
            raise ValueError(
                f"bench trees compares draft trees: --draft {draft.draft} drafts none (pass edd, vdm or a "
                "`spectot train-draft` folder)"
            )
    if bench == "tot" and search is not None and search.search != "tot-bfs":
        raise ValueError(f"bench tot runs ToT-BFS; --search {search.search} is benchmarked by bench spex")
    if bench == "spex" and tree is not None:
        _refuse_set(
            _set(tree, "explore", "k_total", "queries_in_flight"),
            "bench spex sets them for each cell (--variants, --fixed-k-total, --in-flight)",
        )


# the tree searches' own flags (TreeSearchOptions' fields that tot-bfs does not read)
TREE_SEARCH_FLAGS = (
    "budget", "balance_temperature", "max_children", "rest_children", "rest_alpha", "lambda_kv", "lambda_cov", "reward",
    "k_total", "lookahead", "tau", "retract", "fill_rows", "sd_requests", "dfs_speculation", "budget_wakeup",
)  # fmt: skip


def _set(options: Any, *names: str) -> list[str]:
    """The flags among ``names`` whose value is not the field's default: the ones the user set, as typed (a switch
    turned off is ``--no-x``)."""
    known = {f.name: f for f in fields(options)}
    changed = [name for name in names if getattr(options, name) != known[name].default]
    return [
        known[n].metadata.get("flag") or "--" + ("no-" if getattr(options, n) is False else "") + n.replace("_", "-")
        for n in changed
    ]


def _shaping_set(draft: DraftOptions) -> list[str]:
    """The draft flags set besides --draft: they shape speculative decoding."""
    return _set(draft, *(f.name for f in fields(draft) if f.name != "draft"))


def _refuse_set(flags: list[str], why: str) -> None:
    """A ValueError naming ``flags`` a command sets itself (``why``)."""
    if flags:
        raise ValueError(f"{', '.join(flags)}: {why}; drop {'it' if len(flags) == 1 else 'them'}")


def _refuse_unread(flags: list[str], why: str) -> None:
    """A ValueError naming ``flags`` that the run would not read (``why``: what they configure; who ignores them)."""
    if flags:
        raise ValueError(f"{', '.join(flags)} {why} would not read {'it' if len(flags) == 1 else 'them'}")
