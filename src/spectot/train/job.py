"""``spectot train-draft``: corpus -> target features -> trained draft decoder in OUT.

OUT holds ``draft.json`` + ``draft.safetensors`` (what ``--draft OUT`` loads), ``checkpoint.pt``
(``--resume``), ``train.json`` (settings, corpus issues, loss curve summary) and, unless
``--features`` points elsewhere, ``features/`` with one folder per corpus file, named by the file's
name and content hash (another run that trains on that file reuses its shards).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from spectot.config import ModelOptions, TrainDraftOptions
from spectot.train.draft import Report, TrainSettings, extract_features, load_shards, read_corpus, token_counts, train

logger = logging.getLogger(__name__)


def run_train_draft(model: ModelOptions, options: TrainDraftOptions, report: Report | None = None) -> dict:
    from spectot.engine.kernels import cpu_has
    from spectot.engine.runner import ModelRunner
    from spectot.models.draft_decoder import (
        DraftDecoder,
        DraftDecoderConfig,
        embedding_sample,
        fingerprint,
        head_vocabulary,
    )
    from spectot.models.loader import chat_ids, load_model

    torch.manual_seed(options.seed)
    if model.threads:
        torch.set_num_threads(model.threads)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(model.target, dtype=model.dtype, device=model.device)
    if (
        target.model.device.type == "cpu"
        and options.precision == "bf16"
        and not (cpu_has("avx512_bf16") or cpu_has("amx_bf16"))
    ):
        logger.warning(
            "--precision bf16 on a CPU without native bf16 (AVX512-BF16 or AMX) is emulated: on a 2-core AVX2 EPYC it "
            "trained at 47 tokens/s against 1,850 with --precision fp32; use --precision fp32 here"
        )
    tokenizer = target.tokenizer
    init_folder, init_config = _starting_folder(options.init, model.target, options.kind, target.model)
    # --init keeps the draft's hidden layer: its features must come from the layer it reads at inference
    init_layer = init_config.hidden_layer if init_config else None
    inputs = [options.next_token, options.current_token] + (
        [init_config.next_token, init_config.current_token] if init_config else []
    )
    if options.token_lr and not any(inputs):  # without --init TrainDraftOptions refused it before the target loaded
        raise ValueError(
            f"--token-lr is the learning rate of the token inputs; --init {options.init} has none: pass --next-token "
            "or --current-token"
        )
    hidden_layer = options.hidden_layer if init_layer is None else init_layer

    def encode_chat(text: str) -> list[int]:  # a prompt, as Pipeline.encode feeds it at inference
        if not (model.chat_template and tokenizer.chat_template is not None):
            return list(tokenizer(text)["input_ids"])
        return chat_ids(tokenizer, [{"role": "user", "content": text}])  # a refusal: one line's issue, named

    def encode_text(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    layers = int(target.model.config.num_hidden_layers)
    reads_hidden = init_layer is not None if init_config else options.kind == "edd" and options.hidden_states
    if reads_hidden and not -(layers + 1) <= hidden_layer <= layers:  # the embeddings, then each layer
        raise ValueError(
            f"--hidden-layer {hidden_layer}: the target has {layers} layers, so hidden_states indices run "
            f"from {-(layers + 1)} to {layers} (0: the embeddings; -1: the last layer)"
        )
    if init_config is None and options.layers > layers:  # before the features: DraftDecoder.initialise refuses it
        raise ValueError(f"--layers {options.layers}: the target has {layers}; a draft is a small part of it")
    if options.max_len > target.max_context:  # a text line cut to max_len would fail partway through extraction
        raise ValueError(f"--max-len {options.max_len}: the target's context holds {target.max_context} tokens")
    features = Path(options.features) if options.features else out / "features"
    setup = {
        "target": model.target,
        # and its weights: a target retrained or downloaded anew at the same path kept reading the old one's features
        "target_weights": weights_digest(target.model),
        "dtype": model.dtype,
        "hidden_layer": hidden_layer,
        "top_k": options.top_k,
        "max_len": options.max_len,
        "chat_template": model.chat_template,  # how question lines are tokenized
        "generations": "whole context",  # features over a generation's prompt and output, not a window cut from it
        "hidden_dtype": str(target.model.dtype).removeprefix("torch."),  # how the shards store hidden states
    }
    extracted_with = {"kernels": model.kernels, "device": str(target.model.device)}  # recorded, not compared
    vocab = int(target.model.config.vocab_size)
    corpora = [
        (path, *read_corpus([path], encode_chat, encode_text, options.max_len, vocab, target.max_context))
        for path in options.corpus
    ]
    contexts = [ids for _, file_sequences, _ in corpora for ids in file_sequences]
    sequences = [ids[-options.max_len :] for ids in contexts]  # what the draft trains on
    runner = ModelRunner(
        target.model, max_context=target.max_context, capacity=max(map(len, contexts)) + 8, kernels=model.kernels
    )
    issues = [issue for _, _, file_issues in corpora for issue in file_issues]
    for issue in issues:
        logger.warning("%s line %d skipped: %s", issue.path, issue.line, issue.reason)
    total, done, shards, folders = sum(map(len, contexts)), 0, [], []
    for path, file_sequences, _ in corpora:
        folder = features / _features_name(path)
        folders.append(folder.name)
        _check_features_meta(folder, {**setup, "sequences": len(file_sequences)}, extracted_with)

        def progress(stage: str, finished: int, _: int, base: int = done) -> None:
            if report:
                report(stage, base + finished, total)

        shards += extract_features(
            runner, file_sequences, hidden_layer, options.top_k, folder, report=progress, window=options.max_len
        )
        done += sum(map(len, file_sequences))
    del runner

    kind = options.kind
    master = target.model.float()  # the draft trains in fp32; embedding and head are the target's
    if init_folder:
        draft = DraftDecoder.load(
            init_folder, master, add_next_token=options.next_token, add_current_token=options.current_token
        )
        config, head_ids = draft.config, draft.head_ids.cpu()
    else:
        config = DraftDecoderConfig(
            kind=kind,
            num_layers=options.layers or (1 if kind == "edd" else 2),
            hidden_layer=None if kind == "vdm" or not options.hidden_states else options.hidden_layer,
            head_vocab=options.head_vocab,
            target_fingerprint=fingerprint(target.model),
            target_config=target.model.config.to_dict(),
            target_sample=embedding_sample(target.model),
            next_token=options.next_token,
            current_token=options.current_token,
            head_ranked=True,  # head_vocabulary ranks the ids: most frequent first
        )
        head_ids = head_vocabulary(token_counts(sequences, vocab), options.head_vocab, target.eos_token_ids)
        draft = DraftDecoder.initialise(config, master, head_ids)
    settings = TrainSettings(
        block_min=options.block_min,
        block_max=options.block_max,
        loss=options.loss,
        lr=options.lr,
        token_lr=options.token_lr,
        precision=options.precision,
        batch_tokens=options.batch_tokens,
        epochs=options.epochs,
        seed=options.seed,
        checkpoint_minutes=options.checkpoint_minutes,
        use_hidden=config.hidden_layer is not None,
    )
    # what a checkpoint must also match to be resumed: the draft's shape and head, the corpus files in order (their
    # features folders are named by content) and how their features were made
    identity = {
        "draft": {k: v for k, v in asdict(config).items() if k != "target_config"},
        "head_ids": hashlib.blake2b(head_ids.to(torch.int64).numpy().tobytes(), digest_size=8).hexdigest(),
        "corpus": folders,
        "features": setup,
        "chat_template": model.chat_template,
    }
    summary = train(draft, load_shards(shards), settings, out / "checkpoint.pt", options.resume, report, identity)
    draft.save(out, head_ids)
    result = {
        "options": asdict(options),
        "model": asdict(model),
        "draft": {k: v for k, v in asdict(config).items() if k != "target_config"},
        "corpus": {
            "sequences": len(sequences),
            "tokens": sum(map(len, sequences)),
            "skipped_lines": [asdict(i) for i in issues],
        },
        "head_coverage": float(token_counts(sequences, vocab)[head_ids].sum()) / sum(map(len, sequences)),
        "train": summary,
    }
    (out / "train.json.partial").write_text(json.dumps(result, indent=1))
    (out / "train.json.partial").replace(out / "train.json")
    return result


def _starting_folder(init: str, target_name: str, kind: str, target: Any) -> tuple[Path | None, Any]:
    """The folder of the draft ``--init`` names and its config ((None, None) without one), checked before any
    feature is extracted: it must be a draft of ``kind`` trained for this target."""
    from spectot.models.draft_decoder import DraftDecoder, trained_for
    from spectot.pipeline import draft_decoder_folder

    if not init:
        return None, None
    folder = draft_decoder_folder(init, target_name)
    if folder is None:
        raise ValueError(f"--init {init}: not a draft folder (no draft.json) nor a shipped draft (edd, vdm)")
    config = DraftDecoder.read_config(folder)
    if config.kind != kind:
        raise ValueError(f"--init {init} holds a draft of kind {config.kind}: pass --kind {config.kind}")
    if not trained_for(config, target):
        raise ValueError(f"--init {init} was trained for another target (embedding fingerprint differs)")
    return folder, config


def _features_name(path: str) -> str:
    """A corpus file's features folder: its name and a hash of its content (an edited file gets new features)."""
    digest = hashlib.blake2b(Path(path).read_bytes(), digest_size=6).hexdigest()
    return f"{Path(path).stem}-{digest}"


def weights_digest(model: torch.nn.Module) -> str:
    """16 hex digits of every parameter's name, shape and 1,024 values spread over it, rounded to bf16 (the dtype is
    the setup's own entry): a target retrained or fine-tuned (a layer's weights only included) differs, and hashing
    samples costs milliseconds, not a pass over the model."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        k = min(1024, flat.numel())
        picks = torch.arange(k) * (flat.numel() - 1) // max(k - 1, 1)  # integers: a float32 linspace rounded the
        # last index of SmolLM2's 28,311,552-value embedding past its end
        digest.update(f"{name}:{tuple(param.shape)}".encode())
        digest.update(flat[picks].to(torch.bfloat16).float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _check_features_meta(features: Path, meta: dict, extracted_with: dict) -> None:
    """Reuse a features folder only if it was made with this setup; a new one records the setup, and the kernels
    and device that extracted it (for the record: they round alike to within bf16, so they do not refuse reuse)."""
    path = features / "meta.json"
    if path.exists():
        old = json.loads(path.read_text())
        made_with = old.pop("extracted_with", extracted_with)
        old.setdefault("hidden_dtype", "bfloat16")  # folders from before the key stored bf16 hidden states
        unverified = "target_weights" not in old  # folders from before the key: reused (an extraction resumes)
        old.setdefault("target_weights", meta["target_weights"])
        if old != meta:
            raise ValueError(
                f"{features} holds features of another setup ({old}); pass a fresh --features folder or delete it"
            )
        if unverified:  # from now on they are this target's
            logger.warning("%s: made before features recorded the target's weights; reused unverified", features)
            _write_meta(path, {**meta, "extracted_with": made_with})
    else:
        features.mkdir(parents=True, exist_ok=True)
        _write_meta(path, {**meta, "extracted_with": extracted_with})


def _write_meta(path: Path, meta: dict) -> None:
    path.with_suffix(".partial").write_text(json.dumps(meta, indent=1))
    path.with_suffix(".partial").replace(path)  # a kill mid-write leaves no torn meta.json
