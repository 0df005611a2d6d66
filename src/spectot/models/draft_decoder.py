"""Draft decoders spectot trains for a target: EDD and the distilled independent draft (VDM).

EDD (Effective Draft Decoder; Zhang et al. 2024, "Faster Speculative Decoding via Effective Draft
Decoder with Pruned Candidate Tree") is one decoder layer of the target's architecture. Its input is
the target's hidden states h_i from one layer (default the 4th-to-last) as a soft prompt, followed by
the draft block's tokens. With the target's text x_0..x_{T-1} cut into blocks, a token of block j
sees the hidden states of every token before the block and the earlier tokens of its own block
(the *dual-block mask*); at inference the block is [pending token, drafted tokens...] and the hidden
states are those the target's last verification produced, so drafting costs the target nothing.
VDM is the same class without hidden states and with more layers: a small independent draft.

Draft cost on a CPU is dominated by the 49,152-row LM head, so the draft's head covers only the
``head_vocab`` most frequent tokens of its training corpus: q is 0 outside that subset, which the
verification rules handle exactly (a token q cannot propose is simply never drafted). A *ranked* head
(``head_ranked``) stores its ids most frequent first, so any prefix is the best head of its size and
``load(head_size=N)`` keeps the first N rows: the head rows are the target's own, never trained, so the
smaller head is the same draft with q renormalised over fewer tokens (still exact to verify).

Only the draft's own parameters are stored (the layer(s), final norm, hidden projection and the
head's token ids); the embedding and the head rows are the target's, taken when the draft is bound
to its target. A fingerprint of the target's embedding refuses a draft trained for another target.

With ``next_token`` (beyond the paper; EAGLE pairs features with the next token the same way), hidden entry
i is W_h h_i + W_n e(x_{i+1}): the state of a token and the token that followed it. A draft of one layer can
then copy (an induction step: the pending token's query finds an entry whose h_i holds that token, and the
entry's value holds what came next), which the target does when it restates a question's numbers or Creative
Writing's given sentences; h_i alone holds the target's guess of x_{i+1}, not x_{i+1}. x_{i+1} is known
wherever the entry is visible: the entries a block sees end at the token before its pending one. W_n starts
at 0, so a draft trained without it is the same function before fine-tuning.

With ``current_token`` as well, entry i adds W_c e(x_i): the token's own identity. Measured on SmolLM2, W_n alone
did not teach the layer to copy (teacher-forced agreement on a Creative Writing passage the target restates
stayed at 0.22): a late layer's h_i holds the guess of x_{i+1} more than x_i, so no entry held both the key of
an induction match (x_i = the pending token) and its value (x_{i+1}). With W_c e(x_i) + W_n e(x_{i+1}) one entry
holds both, and one attention layer can copy. W_c also starts at 0.

Worked example of the dual-block mask (T = 4 tokens, blocks [0, 1] and [2, 3]; rows are queries,
h = hidden-state entries, x = token entries; 1 = may attend):

             h0 h1 h2 h3  x0 x1 x2 x3
        x0 [  0  0  0  0   1  0  0  0 ]
        x1 [  0  0  0  0   1  1  0  0 ]
        x2 [  1  1  0  0   0  0  1  0 ]
        x3 [  1  1  0  0   0  0  1  1 ]
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

DraftKind = Literal["edd", "vdm"]


@dataclass(frozen=True)
class DraftDecoderConfig:
    kind: DraftKind
    num_layers: int  # decoder layers (EDD: 1)
    hidden_layer: (
        int | None
    )  # target hidden_states index fed as the soft prompt (None: none -- VDM, or the EDD ablation)
    head_vocab: int  # size of the draft head's token subset
    target_fingerprint: str  # sha256 prefix of the target's embedding (see ``fingerprint``)
    target_config: dict  # the target's transformers config (architecture, sizes)
    next_token: bool = False  # EDD: hidden entry i also reads the token that followed it, x_{i+1} (see below)
    current_token: bool = False  # EDD: hidden entry i also reads its own token, x_i (see below)
    head_ranked: bool = False  # head ids stored most frequent first (any prefix is a smaller head)
    target_sample: tuple[float, ...] = ()  # a sample of the target's embedding (``embedding_sample``), fp32

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"a draft decoder needs at least one layer, got {self.num_layers}")


def fingerprint(target: Any) -> str:
    """A short hash of the target's input embedding: equal targets, equal fingerprint, whether
    loaded in fp32 or bf16 (the sample is rounded to bf16 first; fp16 rounds some values differently)."""
    weight = target.get_input_embeddings().weight.detach()
    sample = weight[:: max(1, weight.shape[0] // 64)].to(torch.bfloat16).float().contiguous()
    return hashlib.sha256(sample.cpu().numpy().tobytes()).hexdigest()[:16]


def embedding_sample(target: Any) -> tuple[float, ...]:
    """256 values of the target's input embedding (4 of each of 64 rows spread over the vocabulary)."""
    weight = target.get_input_embeddings().weight.detach()
    sample = weight[:: max(1, weight.shape[0] // 64)][:64, :4].float().flatten().cpu()
    return tuple(round(float(x), 7) for x in sample)


def trained_for(config: DraftDecoderConfig, target: Any) -> bool:
    """Whether the draft was trained for ``target``: its embedding sample within rounding of the stored one
    (fp32, bf16 and fp16 loads of one target agree to ~0.4 %), or, for a draft stored without a sample, the
    fingerprint."""
    if not config.target_sample:
        return fingerprint(target) == config.target_fingerprint
    mine = torch.tensor(embedding_sample(target))
    stored = torch.tensor(config.target_sample)
    return mine.shape == stored.shape and torch.allclose(mine, stored, rtol=1e-2, atol=1e-4)


def dual_block_mask(block_starts: torch.Tensor) -> torch.Tensor:
    """Boolean (2T, 2T) mask over [hidden entries h_0..h_{T-1}, token entries x_0..x_{T-1}].

    ``block_starts``: (T,) int64, s(t) = first position of token t's block. Token x_t sees h_j for
    j < s(t) and x_j for s(t) <= j <= t. Hidden entries see earlier hidden entries (their outputs
    are unused; with one layer their keys and values do not depend on what they see).
    """
    t = block_starts.numel()
    pos = torch.arange(t)
    causal = pos[None, :] <= pos[:, None]  # (T, T) j <= t
    hidden_rows = torch.cat([causal, torch.zeros(t, t, dtype=torch.bool)], 1)
    sees_hidden = pos[None, :] < block_starts[:, None]  # j < s(t)
    sees_block = causal & (pos[None, :] >= block_starts[:, None])  # s(t) <= j <= t
    return torch.cat([hidden_rows, torch.cat([sees_hidden, sees_block], 1)], 0)


def random_block_starts(length: int, low: int, high: int, generator: torch.Generator) -> torch.Tensor:
    """(length,) block start of every position, block lengths drawn uniformly from [low, high]."""
    starts, s = torch.empty(length, dtype=torch.int64), 0
    while s < length:
        size = int(torch.randint(low, high + 1, (), generator=generator))
        starts[s : s + size] = s
        s += size
    return starts


def draft_architecture(target_config: dict, num_layers: int) -> dict:
    """The target's transformers config for a ``num_layers`` draft: every layer full attention (the draft's
    own mask decides what a position sees, in training and at inference; a per-layer ``layer_types`` of the
    target's length, as Qwen2 / Qwen3 carry, refused the config)."""
    config = {**target_config, "num_hidden_layers": num_layers}
    if "layer_types" in config:
        config["layer_types"] = ["full_attention"] * num_layers
    if "sliding_window" in config:
        config["sliding_window"] = None
    if "use_sliding_window" in config:
        config["use_sliding_window"] = False
    return config


class DraftDecoder(nn.Module):
    """The trainable draft: ``model`` is a transformers causal LM of the target's architecture with
    ``num_layers`` layers whose embedding and head are views of the target's (frozen)."""

    def __init__(self, config: DraftDecoderConfig, target: Any, head_ids: torch.Tensor) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        if not trained_for(config, target):
            raise ValueError(
                "this draft was trained for another target (embedding fingerprint differs): "
                "use the target it was trained for, or train one with `spectot train-draft`"
            )
        self.config = config
        cfg = AutoConfig.for_model(**draft_architecture(config.target_config, config.num_layers))
        cfg._attn_implementation = "sdpa"
        embed = target.get_input_embeddings().weight.detach()
        dtype = embed.dtype
        # built with a one-token vocabulary, then given the target's embedding and the head's rows: randomly
        # initialising a full-size embedding and head first took a second per load
        pad, cfg.vocab_size, cfg.pad_token_id = cfg.pad_token_id, 1, None
        self.model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        cfg.vocab_size, cfg.pad_token_id = embed.shape[0], pad
        self.model.model.embed_tokens = nn.Embedding(embed.shape[0], embed.shape[1], pad, _weight=embed, _freeze=True)
        head = target.get_output_embeddings().weight.detach()
        self.model.lm_head = nn.Linear(head.shape[1], head_ids.numel(), bias=False, device="meta")
        self.model.lm_head.weight = nn.Parameter(head[head_ids].clone(), requires_grad=False)
        self.register_buffer("head_ids", head_ids.to(torch.int64), persistent=False)
        width = embed.shape[1]
        self.hidden_proj = nn.Linear(width, width, bias=False, dtype=dtype) if config.hidden_layer is not None else None
        if self.hidden_proj is not None:
            nn.init.eye_(self.hidden_proj.weight)
        self.current_proj = self._token_input(config.current_token, width, dtype)  # W_c, see the module docstring
        self.next_proj = self._token_input(config.next_token, width, dtype)  # W_n

    def _token_input(self, wanted: bool, width: int, dtype: torch.dtype) -> nn.Linear | None:
        """A zero-initialised projection of token embeddings into the hidden entries (EDD only)."""
        if not (wanted and self.hidden_proj is not None):
            return None
        proj = nn.Linear(width, width, bias=False, dtype=dtype)
        nn.init.zeros_(proj.weight)
        return proj

    @classmethod
    def initialise(cls, config: DraftDecoderConfig, target: Any, head_ids: torch.Tensor) -> DraftDecoder:
        """A fresh draft whose layers copy the target's: for EDD the layers that follow the hidden
        layer it reads (they already understand those states), for VDM the first layers (they read
        token embeddings). Measured on SmolLM2: the first KL is 13 nats this way, 52 when copying
        the last layer. The final norm is the target's. Where fewer layers follow the hidden layer than the
        draft has (it reads one of the last), the draft copies the target's last layers: a copied layer, never
        a random one: a draft of more layers than the target has is refused (a draft that deep is no draft)."""
        layers = target.model.layers
        if config.num_layers > len(layers):
            raise ValueError(
                f"a draft of {config.num_layers} layers for a target of {len(layers)}: --layers must be at most "
                f"the target's (a draft is a small part of it)"
            )
        draft = cls(config, target, head_ids)
        first = 0 if config.hidden_layer is None else config.hidden_layer % (len(layers) + 1)
        first = max(0, min(first, len(layers) - config.num_layers))
        source = layers[first : first + config.num_layers]
        with torch.no_grad():
            for mine, theirs in zip(draft.model.model.layers, source):
                mine.load_state_dict(theirs.state_dict())
            draft.model.model.norm.load_state_dict(target.model.norm.state_dict())
        return draft.to(target.device)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The parameters a draft file stores (the target supplies embedding and head rows)."""
        return {k: v for k, v in self.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}

    def forward(
        self,
        tokens: torch.Tensor,  # (B, T) int64
        hidden: torch.Tensor | None,  # (B, T, H) the target's hidden states at tokens, or None (VDM)
        block_starts: torch.Tensor,  # (T,) int64, see dual_block_mask
    ) -> torch.Tensor:
        """Teacher-forced logits over the head subset, (B, T, head_vocab): row t predicts x_{t+1}."""
        inner = self.model.model
        x = inner.embed_tokens(tokens)
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device)
        if self.hidden_proj is not None:
            entries = self.hidden_proj(hidden.to(x.dtype))  # W_h h_i
            if self.current_proj is not None:  # + W_c e(x_i)
                entries = entries + self.current_proj(x)
            if self.next_proj is not None:  # + W_n e(x_{i+1}); the last entry's next token is unseen (0)
                entries = entries + self.next_proj(nn.functional.pad(x[:, 1:], (0, 0, 0, 1)))
            x = torch.cat([entries, x], 1)
            allowed = dual_block_mask(block_starts).to(tokens.device)
            positions = torch.cat([positions, positions])
        else:
            allowed = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()  # VDM: a plain causal LM
        mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(
            ~allowed, torch.finfo(x.dtype).min
        )
        mask = mask[None, None].expand(b, 1, -1, -1)
        cos_sin = inner.rotary_emb(x, positions[None].expand(b, -1))
        for layer in inner.layers:
            x = layer(x, attention_mask=mask, position_ids=positions[None], position_embeddings=cos_sin)
            x = x[0] if isinstance(x, tuple) else x
        x = inner.norm(x[:, -t:])
        return self.model.lm_head(x)

    # -- files -----------------------------------------------------------------------------
    def save(self, directory: str | Path, head_ids: torch.Tensor) -> None:
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.trainable_state().items()}
        state["head_ids"] = head_ids.to(torch.int32).contiguous()
        # each file written aside and renamed, the weights naming their config's digest: a kill between the two
        # renames leaves new weights beside the old config, which load refuses
        save_file(state, str(out / "draft.safetensors.partial"), metadata={"config": config_digest(self.config)})
        (out / "draft.safetensors.partial").replace(out / "draft.safetensors")
        (out / "draft.json.partial").write_text(json.dumps(asdict(self.config), indent=1))
        (out / "draft.json.partial").replace(out / "draft.json")

    @staticmethod
    def read_config(directory: str | Path) -> DraftDecoderConfig:
        """The config of the draft in ``directory`` (its draft.json), without loading weights."""
        root = Path(directory)
        path = root / "draft.json"
        if not path.is_file():
            raise FileNotFoundError(f"{root}: no draft.json; is this a directory written by `spectot train-draft`?")
        try:
            fields = json.loads(path.read_text())
            if "target_sample" in fields:
                fields["target_sample"] = tuple(fields["target_sample"])
            return DraftDecoderConfig(**fields)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: not a draft config spectot can read ({err})") from None

    @classmethod
    def load(
        cls,
        directory: str | Path,
        target: Any,
        add_next_token: bool = False,
        add_current_token: bool = False,
        head_size: int = 0,
    ) -> DraftDecoder:
        """The draft in ``directory`` bound to ``target``; ``add_next_token`` / ``add_current_token``: give an
        EDD trained without W_n / W_c a zero one (the same function), to fine-tune it with that token input;
        ``head_size`` > 0: keep only the first (most frequent) ``head_size`` tokens of a ranked head."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        root = Path(directory)
        config = written = cls.read_config(root)
        asked = {"next_token": add_next_token, "current_token": add_current_token}
        new = [name for name, wanted in asked.items() if wanted and not getattr(config, name)]
        if new and config.hidden_layer is None:
            raise ValueError(f"{root}: token inputs pair hidden states with tokens; this draft reads none")
        config = replace(config, **dict.fromkeys(new, True))
        try:
            with safe_open(str(root / "draft.safetensors"), "pt") as weights:
                written_for = (weights.metadata() or {}).get("config")  # None: saved before the digest
            state = load_file(str(root / "draft.safetensors"))
            head_ids = state.pop("head_ids").to(torch.int64)
        except Exception as err:  # safetensors' own errors (a truncated file) name neither the file nor a cure
            raise ValueError(
                f"{root / 'draft.safetensors'}: cannot read the draft's weights ({type(err).__name__}: {err}); "
                "is the file complete? Retrain it, or copy it again"
            ) from None
        if written_for is not None and written_for != config_digest(written):
            raise ValueError(
                f"{root}: draft.safetensors and draft.json come from two saves (one was cut off between them); "
                "train again (--resume goes on from the checkpoint)"
            )
        if head_size < 0:
            raise ValueError(f"head_size counts tokens (0: the whole head), got {head_size}")
        if 0 < head_size < head_ids.numel():
            if not config.head_ranked:
                raise ValueError(
                    f"{root}: this draft's head is not ranked by frequency, so it cannot be cut to {head_size} "
                    "tokens; rank it with scripts/rank_draft_head.py or retrain it with `spectot train-draft`"
                )
            head_ids = head_ids[:head_size]
            config = replace(config, head_vocab=head_size)
        draft = cls(config, target, head_ids)
        dtype = target.get_input_embeddings().weight.dtype
        missing, unexpected = draft.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
        missing = [k for k in missing if "embed_tokens" not in k and "lm_head" not in k]
        grown = {_TOKEN_INPUT_WEIGHTS[name] for name in new}  # zero: the same function
        missing = [k for k in missing if k not in grown]
        if missing or unexpected:
            raise ValueError(
                f"{root}: draft weights do not match its config (missing {missing}, unexpected {unexpected})"
            )
        return draft.to(target.device).eval()  # the layers were built on the host, the views on the target's device


def config_digest(config: DraftDecoderConfig) -> str:
    """A digest of ``config`` that its weights file carries (``save``), checked on ``load``."""
    as_written = json.loads(json.dumps(asdict(config)))  # as draft.json holds it (integer keys become strings)
    return hashlib.sha256(json.dumps(as_written, sort_keys=True).encode()).hexdigest()[:16]


_TOKEN_INPUT_WEIGHTS = {"next_token": "next_proj.weight", "current_token": "current_proj.weight"}  # config -> W_n, W_c


def head_vocabulary(counts: torch.Tensor, size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """Ids of a ranked head of ``size`` tokens: every id in ``always`` (e.g. the EOS ids, ascending), then the
    most frequent others, most frequent first (``counts``: (V,) occurrences; ties by id). Any prefix of at
    least ``len(always)`` ids is the head this rule picks for that size."""
    forced = sorted({int(t) for t in always})
    size = min(size, counts.numel())
    if len(forced) > size:
        raise ValueError(f"{len(forced)} required token ids do not fit a head of {size}")
    taken = set(forced)
    ranked = [t for t in counts.argsort(descending=True, stable=True).tolist() if t not in taken]
    return torch.tensor(forced + ranked[: size - len(forced)], dtype=torch.int64)


def rank_head(head_ids: torch.Tensor, counts: torch.Tensor, always: Sequence[int] = ()) -> torch.Tensor:
    """The ids of an existing head in ``head_vocabulary``'s order: ``always`` ids first, then by ``counts``
    (most frequent first, ties by id). The same set, so the draft computes the same function.

    Example: head [3, 5, 9], counts[3, 5, 9] = 1, 7, 7, always (9,) -> [9, 5, 3]."""
    ids = head_ids.to(torch.int64)
    sub = torch.zeros_like(counts)
    sub[ids] = counts[ids] + 1  # outside the head: 0, below every head id
    return head_vocabulary(sub, ids.numel(), [t for t in always if t in set(ids.tolist())])
