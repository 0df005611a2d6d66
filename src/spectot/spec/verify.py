"""Chain verification: which drafted tokens the target accepts, and the token that follows.

Vocabulary (used across spectot, after Leviathan et al. 2023 and Chen et al. 2023):
- *accepted* tokens: draft tokens the target keeps;
- *recovered* token: sampled from the residual norm(max(p - q, 0)) at the first rejection;
- *bonus* token: sampled from the target after the last draft token when every draft is accepted.
Every verification emits accepted tokens plus exactly one recovered-or-bonus token, so
"acceptance length" = accepted + 1 (it **includes** the bonus/recovered token).

p: target probabilities, q: draft probabilities (the distribution the draft token was drawn from;
one-hot for deterministic drafts such as greedy or n-gram, or the output is not lossless).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from spectot.spec.sampling import sample


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # draft tokens accepted, 0..k
    next_token: int  # the recovered (on rejection) or bonus (all accepted) token


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)); where p == q the residual is 0/0 and we fall back to p (the rejection
    has probability 0 there, so any choice is exact, and generation never stops on NaN)."""
    r = (p - q).clamp_min_(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / torch.where(total > 0, total, 1.0), p)


def verify_chain(
    draft: torch.Tensor,  # (k,) int64 draft tokens x_1..x_k
    p: torch.Tensor,  # (k + 1, V) target probs; row i is p(. | prefix, x_1..x_i)
    q: torch.Tensor | None,  # (k, V) draft probs, or None for a deterministic (one-hot) draft
    generator: torch.Generator | None,
) -> Verdict:
    """Speculative sampling: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); on the first
    rejection sample the recovered token from norm(max(p_i - q_i, 0)); if all k are accepted, sample
    the bonus token from p_{k+1}. The emitted tokens are distributed exactly as the target's."""
    k = draft.numel()
    idx = torch.arange(k)
    p_x = p[idx, draft]  # (k,)
    q_x = torch.ones(k) if q is None else q[idx, draft]
    fixed = q_x <= 0  # a token q could not have drawn: a fixed candidate, q = one-hot (as the tree rule has it)
    u = torch.rand(k, generator=generator)
    # accept iff u < p/q, written without dividing and as the acceptance: a NaN q (a draft whose logits
    # overflowed) then rejects, where "u q >= p" read False and accepted every token, forbidden ones too
    rejected = (~(u * q_x.masked_fill(fixed, 1.0) < p_x)).nonzero()
    if rejected.numel() == 0:
        return Verdict(k, int(sample(p[k], generator)))
    i = int(rejected[0])  # host sync: the acceptance length decides what to commit
    one_hot = q is None or bool(fixed[i])
    q_i = torch.zeros_like(p[i]).index_fill_(0, draft[i : i + 1], 1.0) if one_hot else q[i]
    return Verdict(i, int(sample(residual(p[i], q_i), generator)))


def verify_chain_greedy(draft: torch.Tensor, target_argmax: torch.Tensor) -> Verdict:
    """Greedy: accept the longest prefix equal to the target's argmax; the next token is the
    target's argmax after it (the coupled rule with the argmax as the target's token). ``target_argmax``: (k + 1,)."""
    return verify_chain_coupled(draft, lambda i: int(target_argmax[i]))


def verify_chain_coupled(draft: torch.Tensor, target_token: Callable[[int], int]) -> Verdict:
    """Coupled verification of a deterministic draft (n-gram, greedy or top-k draft tokens): the
    target's token at depth i is ``target_token(i)`` = argmax p_i / E_i, drawn with the stream's own
    noise for that position (``sampling.sample_at``) exactly as plain decoding draws it. Accept while
    the draft equals it; the first mismatch, or the bonus position, emits the target's token. The
    output is plain decoding's, token for token, so it is distributed as the target's. A draft token
    chosen without the noise is accepted with probability p_i(x_i), what ``verify_chain`` gives a one-hot q;
    one chosen with it (a draft decoder's coupled guess, argmax q_i / E_i) with P(argmax q_i / E_i =
    argmax p_i / E_i), which tends to 1 as q tends to p."""
    for i, x in enumerate(draft.tolist()):
        token = target_token(i)
        if x != token:
            return Verdict(i, token)
    return Verdict(draft.numel(), target_token(draft.numel()))
