"""Training spectot's draft decoders (EDD, VDM) on the target's own distributions.

Three resumable stages, each shows progress through the ``report`` callback:

1. corpus: JSONL lines -> token sequences. A line may be an engine output (``prompt_ids`` +
   ``token_ids``, what ``spectot generate --json`` prints and ``spectot solve --generations`` writes:
   the target's own generations; cut to their last ``max_len`` tokens), a
   question/answer pair (GSM8K: chat-templated question + answer, calculator annotations removed) or ``{"text": ...}``. A line that
   does not parse is reported with its number and skipped; one too short to train on is dropped with a warning.
2. features: the frozen target runs every sequence once (spectot's engine, the dtype the draft will
   be used with, so training sees the hidden states inference sees) and stores, per token, the
   hidden state of the chosen layer (in that dtype) and the target's top-``top_k`` next-token probabilities. Shards
   are written as they finish; a rerun skips the ones present.
3. training: teacher forcing with the dual-block mask (block lengths L ~ U[block_min, block_max], drawn for each
   block of each step: the shipped drafts were trained so), loss KL(P_target || P_draft) over the draft head's tokens (the target's top-k,
   renormalised on the head's subset; ``ce``: cross-entropy on the target's argmax instead),
   AdamW. Checkpoints every few minutes; ``resume`` continues from the last one bit for bit.
"""

from __future__ import annotations

import json
import logging
import contextlib
import math
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from spectot.data.jsonl import DataError, decode_line

logger = logging.getLogger(__name__)

Loss = Literal["kl", "ce"]
Report = Callable[..., None]  # report(stage, done, total, **metrics)


@dataclass(frozen=True)
class CorpusIssue:
    path: str
    line: int
    reason: str


# -- 1. corpus ---------------------------------------------------------------------------------
def read_corpus(
    paths: Sequence[str],
    encode_chat: Callable[[str], list[int]],
    encode_text: Callable[[str], list[int]],
    max_len: int,
    vocab_size: int | None = None,
    context: int | None = None,
) -> tuple[list[list[int]], list[CorpusIssue]]:
    """Token sequences of every usable line and the lines that were skipped. A text or question line is cut to
    its first ``max_len`` tokens; an engine's generation keeps its whole prompt and output (its last ``context``
    tokens, the target's context, where longer): ``extract_features`` trains on its last ``max_len`` tokens with
    the hidden states the target computed over all of it, as at inference, not over a window cut from its start.

    ``vocab_size`` (the target's) range-checks token ids: a corpus tokenized for another model is
    caught here, not as an index error deep in feature extraction. Lines of fewer than 2 tokens
    (nothing to predict) are dropped with a warning and listed among the issues.
    """
    sequences, issues, dropped = [], [], 0
    for path in paths:
        if Path(path).is_dir():
            raise DataError(f"corpus {path} is a directory, expected a file")
        if not Path(path).is_file():
            raise FileNotFoundError(f"corpus file {path} does not exist")
        short = []
        with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is one issue, not the end of the file
            for number, raw in enumerate(f, start=1):
                try:
                    line = decode_line(path, number, raw)
                    if not line.strip():
                        continue
                    ids, generated = _line_tokens(json.loads(line), encode_chat, encode_text, vocab_size)
                except (DataError, json.JSONDecodeError, KeyError, TypeError, ValueError, RecursionError) as err:
                    issues.append(CorpusIssue(path, number, f"{type(err).__name__}: {err}"))
                    continue
                if len(ids) < 2:
                    short.append(number)
                    issues.append(CorpusIssue(path, number, f"{len(ids)} token(s): nothing to predict"))
                    continue
                sequences.append((ids[-context:] if context else ids) if generated else ids[:max_len])
        dropped += len(short)
        if short:
            lines = ", ".join(map(str, short[:5])) + (", ..." if len(short) > 5 else "")
            logger.warning("%s: %d line(s) of fewer than 2 tokens dropped (lines %s)", path, len(short), lines)
    if not sequences:
        first = "; ".join(f"{i.path}:{i.line}: {i.reason}" for i in issues[:3]) + ("; ..." if len(issues) > 3 else "")
        raise DataError(
            f"no usable lines in {', '.join(paths)} ({len(issues) - dropped} malformed, {dropped} too short)"
            + (f": {first}" if issues else "")
        )
    return sequences, issues


def _line_tokens(
    record: Any, encode_chat: Callable, encode_text: Callable, vocab_size: int | None
) -> tuple[list[int], bool]:
    """The line's token ids, and whether they are an engine's generation (prompt + token ids)."""
    if not isinstance(record, dict):
        raise TypeError("expected a JSON object")
    if "token_ids" in record:
        ids = list(record.get("prompt_ids", [])) + list(record["token_ids"])
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError("prompt_ids/token_ids must be non-negative integers")
        if vocab_size is not None and ids and max(ids) >= vocab_size:
            raise ValueError(
                f"token id {max(ids)} is outside the target's vocabulary of {vocab_size}; "
                "was this corpus tokenized for another model?"
            )
        return ids, True
    if "question" in record:  # GSM8K: drop the calculator annotations <<48/2=24>>, which models do not write
        question, answer = _string(record, "question"), _string(record, "answer", default="")
        return encode_chat(question) + encode_text(re.sub(r"<<[^>]*>>", "", answer)), False
    return encode_text(_string(record, "text")), False


def _string(record: dict, field: str, default: str | None = None) -> str:
    """A text field, refused unless a string: str() would train on "None" or "[1, 2]"."""
    if field not in record and default is not None:
        return default
    value = record[field]
    if not isinstance(value, str):
        raise TypeError(f"'{field}' must be a string, got {type(value).__name__}")
    return value


def token_counts(sequences: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.int64)
    for ids in sequences:
        counts += torch.bincount(torch.tensor(ids), minlength=vocab)[:vocab]
    return counts


# -- 2. features -------------------------------------------------------------------------------
def extract_features(
    runner: Any,  # spectot.engine.runner.ModelRunner over the target
    sequences: Sequence[Sequence[int]],
    hidden_layer: int,
    top_k: int,
    out: Path,
    shard_tokens: int = 16384,
    report: Report | None = None,
    window: int | None = None,
) -> list[Path]:
    """Write shards of {tokens, hidden, top_ids, top_probs} per sequence; skip shards already there. With a
    ``window`` a record holds the last ``window`` tokens of its sequence, their features computed over all of it."""
    from spectot.engine.runner import StreamTree
    from spectot.engine.token_tree import TokenTree

    out.mkdir(parents=True, exist_ok=True)
    shards, current, size = [], [], 0
    for i, ids in enumerate(sequences):
        current.append(i)
        size += len(ids)
        if size >= shard_tokens or i == len(sequences) - 1:
            shards.append(current)
            current, size = [], 0
    total = sum(len(s) for s in sequences)
    done, reported, paths = 0, 0, []
    for index, members in enumerate(shards):
        path = out / f"shard_{index:04d}.pt"
        paths.append(path)
        computed = not path.exists()
        if computed:
            if report and done > reported:  # the shards already there, in one jump (a speed estimate ignores it)
                report("features", done, total)
            records = []
            for i in members:
                stream = runner.new_stream()
                length = len(sequences[i])
                keep = -window if window else 0  # [-window:] is the whole sequence when it is shorter
                rows = range(max(0, length - window) if window else 0, length)  # the logits of those only
                try:
                    result = runner.forward(
                        [StreamTree(stream, TokenTree.chain(sequences[i]))],
                        logit_rows=[rows],
                        hidden_layer=hidden_layer,
                    )
                    runner.commit({})
                finally:
                    runner.release(stream)
                probs = result.logits[0].softmax(-1)  # (T, V) float32
                top = probs.topk(top_k, dim=-1)
                records.append(
                    {
                        "tokens": torch.tensor(sequences[i][keep:], dtype=torch.int32),
                        # host tensors, in the dtype inference reads; a copy of the window alone (a view saved the
                        # whole context's storage: 13x the bytes for a 2,000-token generation cut to 100)
                        "hidden": result.hidden[0][keep:].to("cpu", copy=True),
                        "top_ids": top.indices.to(torch.int32),
                        "top_probs": top.values.to(torch.float16),
                    }
                )
            tmp = path.with_suffix(".partial")
            torch.save(records, tmp)
            tmp.rename(path)  # a shard is either complete or absent
        done += sum(len(sequences[i]) for i in members)
        if report and (computed or index == len(shards) - 1):
            report("features", done, total)
            reported = done
    return paths


# -- 3. training -------------------------------------------------------------------------------
def distill_loss(
    logits: torch.Tensor,  # (B, T, V') draft logits over the head subset
    top_index: torch.Tensor,  # (B, T, K) int64 index into the head subset, -1 where the token is outside it
    top_probs: torch.Tensor,  # (B, T, K) float the target's probabilities of those tokens
    valid: torch.Tensor,  # (B, T) bool: positions that count
    kind: Loss = "kl",
) -> torch.Tensor:
    """KL(P_target || P_draft) on the head subset, P_target renormalised there; ``ce``: -log q(argmax p)."""
    log_q = logits.float().log_softmax(-1)
    inside = top_index >= 0
    p = torch.where(inside, top_probs.float(), 0.0)
    if kind == "ce":  # the target's argmax only (the first of the sorted top-k)
        p = torch.zeros_like(p)
        p[..., 0] = inside[..., 0].float()
    mass = p.sum(-1, keepdim=True)
    p = torch.where(mass > 0, p / mass.clamp_min(1e-12), 0.0)
    log_q_top = log_q.gather(-1, top_index.clamp_min(0))
    per_token = (p * (torch.log(p.clamp_min(1e-12)) - log_q_top)).sum(-1)  # KL; 0 * log 0 = 0
    keep = valid & (mass[..., 0] > 0)
    return (per_token * keep).sum() / keep.sum().clamp_min(1)


@dataclass(frozen=True)
class TrainSettings:
    block_min: int = 5
    block_max: int = 10
    loss: Loss = "kl"
    lr: float = 1e-4  # peak: linear warm-up over the first 2% of steps, cosine decay to lr / 10
    token_lr: float = 0.0  # peak lr of EDD's token inputs W_c, W_n (0: lr), on the same schedule
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: autocast matmuls, fp32 weights, optimizer and loss
    batch_tokens: int = 2048
    epochs: float = 1.0
    seed: int = 0
    checkpoint_minutes: float = 5.0
    use_hidden: bool = True


def load_shards(paths: Sequence[Path]) -> list[dict]:
    return [record for path in paths for record in torch.load(path)]


def make_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Sequences of similar length together (little padding), at most ``batch_tokens`` padded tokens a batch; a
    sequence longer than that is a batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


def collate(records: Sequence[dict], members: list[int], head_index: torch.Tensor) -> dict[str, torch.Tensor]:
    """Pad a batch; map the target's top-k token ids to head-subset indices (-1 outside)."""
    length = max(records[i]["tokens"].numel() for i in members)
    b, k = len(members), records[members[0]]["top_ids"].shape[1]
    width = records[members[0]]["hidden"].shape[1]
    batch = {
        "tokens": torch.zeros(b, length, dtype=torch.int64),
        "hidden": torch.zeros(b, length, width),
        "top_index": torch.full((b, length, k), -1, dtype=torch.int64),
        "top_probs": torch.zeros(b, length, k),
        "valid": torch.zeros(b, length, dtype=torch.bool),
    }
    for row, i in enumerate(members):
        r, n = records[i], records[i]["tokens"].numel()
        batch["tokens"][row, :n] = r["tokens"].long()
        batch["hidden"][row, :n] = r["hidden"].float()
        batch["top_index"][row, :n] = head_index[r["top_ids"].long()]
        batch["top_probs"][row, :n] = r["top_probs"].float()
        batch["valid"][row, :n] = True
    return batch


def train(
    draft: Any,  # spectot.models.draft_decoder.DraftDecoder, fp32, trainable
    records: Sequence[dict],
    settings: TrainSettings,
    checkpoint: Path,
    resume: bool,
    report: Report | None = None,
    identity: dict | None = None,
) -> dict:
    """Train ``draft`` in place; returns the training summary (final loss, steps, tokens). ``identity``: what
    else a checkpoint must match to be resumed (the job's draft and corpus, see ``run_train_draft``)."""
    from spectot.models.draft_decoder import random_block_starts

    vocab = int(draft.model.config.vocab_size)
    head_index = torch.full((vocab,), -1, dtype=torch.int64)
    head_index[draft.head_ids.cpu()] = torch.arange(draft.head_ids.numel())
    params = [p for p in draft.parameters() if p.requires_grad]
    device = params[0].device
    groups = [{"params": params}]
    token_inputs = {id(p) for m in (draft.current_proj, draft.next_proj) if m is not None for p in m.parameters()}
    if settings.token_lr and token_inputs:  # their own peak lr: from 0 under --init they need larger steps
        groups = [
            {"params": [p for p in params if id(p) not in token_inputs]},
            {"params": [p for p in params if id(p) in token_inputs], "lr": settings.token_lr},
        ]
    optimizer = torch.optim.AdamW(groups, lr=settings.lr)
    batches = make_batches([r["tokens"].numel() for r in records], settings.batch_tokens)
    total_steps = max(1, math.ceil(settings.epochs * len(batches)))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: learning_rate_factor(step, total_steps))
    state = {"step": 0, "losses": [], "tokens": 0, "seconds": 0.0}
    job = _job_identity(records, settings) | ({"identity": identity} if identity else {})
    if resume and checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False, map_location=device)
        if saved.get("job", job) != job:
            differ = sorted(k for k in {*job, *saved.get("job", {})} if job.get(k) != saved["job"].get(k))
            raise ValueError(
                f"{checkpoint} belongs to another training job ({', '.join(differ)} differ): resume it with its own "
                f"--corpus files (in the same order) and flags, or train into a new --out folder"
            )
        missing, unexpected = draft.load_state_dict(saved["model"], strict=False)
        missing = [k for k in missing if "embed_tokens" not in k and "lm_head" not in k]  # the target's, not saved
        if missing or unexpected:
            raise ValueError(f"{checkpoint} does not fit this draft (missing {missing}, unexpected {unexpected})")
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        state = saved["state"]
        logger.info("resumed at step %d of %d", state["step"], total_steps)
    elif resume:
        logger.warning("--resume: %s holds no checkpoint; training starts at step 0", checkpoint)
    last_save = time.monotonic()
    draft.train()
    with _stop_between_steps() as stop:  # Ctrl-C / SIGTERM end the loop between steps
        while state["step"] < total_steps and not stop.asked:
            step = state["step"]
            epoch, position = divmod(step, len(batches))
            order = list(range(len(batches)))
            random.Random(settings.seed * 1000 + epoch).shuffle(order)  # same order on resume
            batch = {k: v.to(device) for k, v in collate(records, batches[order[position]], head_index).items()}
            gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
            starts = random_block_starts(batch["tokens"].shape[1], settings.block_min, settings.block_max, gen)
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=settings.precision == "bf16"):
                logits = draft(batch["tokens"], batch["hidden"] if settings.use_hidden else None, starts)
            loss = distill_loss(logits, batch["top_index"], batch["top_probs"], batch["valid"], settings.loss)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            state["step"] += 1
            state["tokens"] += int(batch["valid"].sum())
            state["seconds"] += time.perf_counter() - t0
            state["losses"].append(float(loss.detach()))
            if report:
                recent = state["losses"][-50:]
                report(
                    "train",
                    state["step"],
                    total_steps,
                    loss=sum(recent) / len(recent),
                    tokens_per_s=state["tokens"] / state["seconds"],
                )
            if time.monotonic() - last_save > 60 * settings.checkpoint_minutes or state["step"] == total_steps:
                _save_checkpoint(checkpoint, draft, optimizer, schedule, state, job)
                last_save = time.monotonic()
        if stop.asked and state["step"] < total_steps:  # Ctrl-C or SIGTERM: --resume goes on from the saved step
            _save_checkpoint(checkpoint, draft, optimizer, schedule, state, job)
            raise KeyboardInterrupt(f"training stopped at step {state['step']}; checkpoint saved: resume with --resume")
    draft.eval()
    recent = state["losses"][-50:]
    return {
        "steps": state["step"],
        "tokens": state["tokens"],
        "seconds": state["seconds"],
        "final_loss": sum(recent) / max(1, len(recent)),
    }


class _StopRequest:
    asked = False


@contextlib.contextmanager
def _stop_between_steps():
    """SIGINT and SIGTERM ask the loop to stop after the step it is in (main thread only; elsewhere they act as
    they always do)."""
    request = _StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def ask(signum, frame) -> None:
        if request.asked:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        request.asked = True

    previous = {sig: signal.signal(sig, ask) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def learning_rate_factor(step: int, total: int) -> float:
    """Multiplier of the peak learning rate: linear warm-up over 2% of the steps, cosine to 0.1."""
    warmup = max(1, total // 50)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _job_identity(records: Sequence[dict], settings: TrainSettings) -> dict:
    """What a checkpoint must match to be resumed: the settings that shape training (not how often it
    checkpoints) and the corpus (sequence count and tokens)."""
    lengths = [r["tokens"].numel() for r in records]
    shaping = {k: v for k, v in asdict(settings).items() if k != "checkpoint_minutes"}
    if not settings.token_lr:  # unset: the identity of checkpoints written before the setting existed
        del shaping["token_lr"]
    return {"settings": shaping, "sequences": len(lengths), "tokens": sum(lengths)}


def _save_checkpoint(
    path: Path, draft: Any, optimizer: torch.optim.Optimizer, schedule: Any, state: dict, job: dict
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    payload = {
        "job": job,
        "model": draft.trainable_state(),
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "state": state,
    }
    torch.save(payload, tmp)
    tmp.rename(path)
