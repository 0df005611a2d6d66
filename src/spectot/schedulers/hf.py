"""``hf-batched-ar``: what a user would do instead of spectot — a level's prompts as one left-padded
batch through transformers' ``generate()`` (SEED's "Parallel" strategy, figure 1(d), done the
usual way), as the baseline next to spectot's own ``batched-ar``.

It samples with transformers' random numbers (one seed per level, the level's first stream's), so
its trees follow the target's distribution without spectot's per-stream draws. Stop strings end a
row as in spectot's decoder: at the token whose text completes one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, StoppingCriteria

from spectot.schedulers.base import Level, Recorder
from spectot.schedulers.timeline import Timeline
from spectot.spec.decoding import CONTEXT_TOKENS, FinishReason, PromptRefused, StreamResult, hit_stop
from spectot.spec.stats import DecodeStats


@dataclass
class HFBatchedEngine:
    model: object  # a transformers causal LM
    eos_token_ids: Sequence[int]
    detokenize: Callable[[list[int]], str]
    max_context: int  # tokens a row may hold, as spectot's engines check it (generate() would run past it)
    name: str = "hf-batched-ar"

    def run(self, level: Level, timeline: Timeline | None = None) -> list[StreamResult]:
        rec = Recorder(timeline, level)
        config, prompts = level.config, [list(p) for p in level.prompts]
        for i, p in enumerate(prompts):
            if len(p) + config.max_new_tokens > self.max_context:
                raise PromptRefused(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={config.max_new_tokens} it exceeds the "
                    f"model's context of {self.max_context} tokens"
                )
        pad = self.eos_token_ids[0]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every row's next token is at the same column
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        s = config.sampling
        sampling = {"do_sample": False}
        if not s.greedy:
            sampling = {"do_sample": True, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}
        generation = GenerationConfig(
            max_new_tokens=config.max_new_tokens,
            eos_token_id=list(self.eos_token_ids),
            pad_token_id=pad,
            output_logits=True,
            return_dict_in_generate=True,
            **sampling,
        )
        t = rec.now()
        # generate() fills every field ``generation`` leaves unset from the checkpoint's generation_config (a
        # repetition_penalty, a min_new_tokens: no longer plain decoding), so a bare one stands in meanwhile
        shipped, self.model.generation_config = self.model.generation_config, GenerationConfig()
        try:
            with torch.random.fork_rng(), torch.inference_mode():
                torch.manual_seed(level.seeds[0])
                out = self.model.generate(
                    input_ids=ids.to(self.model.device),
                    attention_mask=mask.to(self.model.device),
                    generation_config=generation,
                    stopping_criteria=[_StopStrings(config.stop, self.detokenize, width)] if config.stop else None,
                )
        finally:
            self.model.generation_config = shipped
        rec.add(range(len(prompts)), "verify", t, rec.now())
        logprobs = torch.stack(out.logits, 1).float().log_softmax(-1)  # (rows, steps, V), temperature 1
        new = out.sequences[:, width:].cpu()
        return [
            self._result(p, new[i].tolist(), logprobs[i], config.stop, len(out.logits)) for i, p in enumerate(prompts)
        ]

    def _result(self, prompt, row: list[int], logprobs, stop: tuple[str, ...], steps: int) -> StreamResult:
        tokens: list[int] = []
        finish: FinishReason = "length"
        for token in row:
            tokens.append(token)
            if token in self.eos_token_ids:
                finish = "eos"
                break
            if stop and hit_stop(tokens, stop, self.detokenize, prompt):
                finish = "stop"
                break
        stats = DecodeStats(new_tokens=len(tokens), prompt_tokens=len(prompt), target_forwards=steps)
        stats.verify_steps = max(len(tokens) - 1, 0)  # as spectot counts: the prefill gives the first token
        chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
        return StreamResult(prompt, tokens, finish, stats, chosen)


class _StopStrings(StoppingCriteria):
    """transformers stopping criterion: per row, whether its new text (read after its prompt's) holds a stop
    string. Rows are left-padded with the EOS, which decodes to nothing."""

    def __init__(self, stop: tuple[str, ...], detokenize, prompt_width: int) -> None:
        self.stop, self.detokenize, self.width = stop, detokenize, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        rows = input_ids[:, self.width :].tolist()
        prompts = input_ids[:, max(self.width - CONTEXT_TOKENS, 0) : self.width].tolist()  # their last tokens
        hits = [hit_stop(r, self.stop, self.detokenize, p) for r, p in zip(rows, prompts)]
        return torch.tensor(hits, device=input_ids.device)
