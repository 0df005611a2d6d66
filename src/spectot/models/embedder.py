"""Sentence embeddings for ETS's semantic coverage (Hooper et al. 2025 cluster reasoning steps by the cosine
distance of their embeddings; the authors used a math-BERT encoder).

``load_embedder(name)`` loads any Hugging Face encoder (or decoder) checkpoint by alias, folder or hub id and
returns a ``TextEmbedder``: texts -> (T, H) unit vectors, the mean of the last hidden layer over each text's
tokens (padding masked out, so a text's vector does not depend on the batch it is embedded in, up to rounding):

    e(x) = normalise( sum_i m_i h_i / sum_i m_i )      h_i: last hidden state of token i, m_i: 1 for real tokens

Runs in fp32 on the given device; texts are cut to the model's context or 512 tokens, whichever is shorter (a
step is a few dozen tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from spectot.models.loader import ModelLoadError, hub_cached, hub_reachable, resolve_checkpoint, resolve_device
from spectot.models.registry import find_alias


@dataclass
class TextEmbedder:
    model: Any  # a transformers PreTrainedModel whose forward gives last_hidden_state
    tokenizer: Any
    max_length: int
    batch_size: int = 32

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        """(T, H) float64 unit vectors (an empty text: the mean over its special tokens, or zeros if none)."""
        import torch

        if not texts:
            return np.zeros((0, int(self.model.config.hidden_size)))
        rows = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                list(texts[start : start + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.model.device)
            if batch["input_ids"].shape[1] == 0:  # only empty texts and no special tokens: nothing to run
                rows.append(
                    torch.zeros(
                        batch["input_ids"].shape[0], int(self.model.config.hidden_size), device=self.model.device
                    )
                )
                continue
            with torch.inference_mode():
                hidden = self.model(**batch).last_hidden_state.float()  # (b, L, H)
            mask = batch["attention_mask"].unsqueeze(-1).float()  # (b, L, 1)
            rows.append((hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0))
        vectors = torch.cat(rows).double().cpu().numpy()
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 0)


def load_embedder(name_or_path: str, device: str = "cpu", batch_size: int = 32) -> TextEmbedder:
    """A ``TextEmbedder`` over the checkpoint's base model (a causal LM's decoder stack works too)."""
    from transformers import AutoModel, AutoTokenizer

    device = resolve_device(device)  # 'auto' too, as the target's --device
    source = resolve_checkpoint(name_or_path)
    if isinstance(source, str) and not hub_cached(source) and not hub_reachable():
        raise ModelLoadError(
            f"could not load the embedder '{name_or_path}': the hub cannot be reached and it is not in the local "
            "cache; download it elsewhere and pass its folder"
        )
    try:
        model = AutoModel.from_pretrained(source, dtype="float32").to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as err:  # a missing tokenizer file, a truncated checkpoint, a config AutoModel cannot map
        cure = "delete it and load the alias again" if find_alias(name_or_path) is not None else "is it complete?"
        raise ModelLoadError(f"{source}: cannot load an embedder ({type(err).__name__}: {err}); {cure}") from None
    if tokenizer.pad_token is None:  # decoder tokenizers often have none; padded rows are masked out anyway
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    if tokenizer.pad_token is None:
        raise ModelLoadError(f"{source}: the tokenizer has no pad, EOS or unknown token to pad batches with")
    limit = int(getattr(model.config, "max_position_embeddings", 512) or 512)
    return TextEmbedder(model, tokenizer, min(limit, 512), batch_size)
