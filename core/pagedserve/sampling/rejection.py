"""Lossless verification of draft tokens: what a step emits has the target's distribution exactly.

A request scored k drafts x_1..x_k and the target gave a distribution p_j at each of its k + 1
positions (after every sampling parameter: penalties, logit bias, grammar masks, temperature,
top-k/top-p/min-p). The draft proposed x_j from its own distribution q_j. Then (Leviathan et al.,
Chen et al., 2023), going left to right:

  * accept x_j with probability min(1, p_j(x_j) / q_j(x_j)) (drawn as u * q_j(x_j) <= p_j(x_j));
  * at the first rejection emit one token from normalize(max(0, p_j - q_j)) and stop;
  * when all k are accepted, emit a bonus token from p_{k+1}.

Each emitted token is distributed as p at its position, whatever q is; q only decides how many are
accepted. Greedy rows (temperature 0) are the limit where p is one-hot at the argmax: accept while
the draft equals it, then emit the argmax. A deterministic proposer (n-gram lookup, or a draft that
takes its argmax) has a one-hot q, and the rule reduces to "sample y_j from p_j, accept while
y_j == x_j": the model runner verifies that way, position by position, with the batched sampler.
`verify_drafts` is the general rule, for proposers that hand over their q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.sampling.argmax import first_argmax

_MIN_NOISE = 1e-20  # as the sampler's exponential race: one 0 would make p / E infinite


@dataclass(frozen=True, slots=True)
class VerifiedDrafts:
    """What a step emits per request: its accepted drafts, then one more token."""

    # [num_reqs, max_drafts + 1] int64; row r's first num_emitted[r] entries are its tokens, the
    # rest are 0 and mean nothing
    token_ids: torch.Tensor
    num_emitted: torch.Tensor  # [num_reqs] int64 in [1, num_drafts[r] + 1]: accepted drafts + 1

    def as_lists(self) -> list[list[int]]:
        """Each request's emitted tokens on the host. Waits for the device. Does not mutate."""
        rows = self.token_ids.tolist()
        return [row[:n] for row, n in zip(rows, self.num_emitted.tolist(), strict=True)]


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [n, vocab] (rows sum to 1, or to any positive mass): the
    exponential race argmax(p_i / E_i), E_i ~ Exp(1), as the sampler draws. Does not mutate."""
    noise = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return first_argmax(probs.float() / noise.clamp_min_(_MIN_NOISE))


def verify_drafts(
    target_probs: torch.Tensor,  # [num_reqs, max_drafts + 1, vocab] p at each position, rows sum to 1
    draft_token_ids: torch.Tensor,  # [num_reqs, max_drafts] int64; entries past num_drafts ignored
    num_drafts: torch.Tensor,  # [num_reqs] int64 in [0, max_drafts]
    draft_probs: torch.Tensor | None,  # [num_reqs, max_drafts, vocab] q; None: one-hot at the drafts
    generator: torch.Generator | None = None,
) -> VerifiedDrafts:
    """Rejection sampling of a batch of requests' drafts (module docstring). Every tensor on one
    device. Does not mutate its inputs (the generator's state advances)."""
    num_reqs, width, vocab = target_probs.shape
    k = width - 1
    if draft_token_ids.shape != (num_reqs, k) or num_drafts.shape != (num_reqs,):
        raise ValueError(
            f"draft_token_ids must be [{num_reqs}, {k}] and num_drafts [{num_reqs}] for target_probs "
            f"{tuple(target_probs.shape)}; got {tuple(draft_token_ids.shape)} and {tuple(num_drafts.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (num_reqs, k, vocab):
        raise ValueError(f"draft_probs must be [{num_reqs}, {k}, {vocab}], got {tuple(draft_probs.shape)}")
    device = target_probs.device
    p = target_probs.float()
    drafts = draft_token_ids.long()
    p_draft = p[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [num_reqs, k] p_j(x_j)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.float().gather(2, drafts.unsqueeze(2)).squeeze(2)
    u = torch.rand((num_reqs, k), generator=generator, device=device)
    positions = torch.arange(k, device=device)
    accepted = (u * q_draft <= p_draft) & (positions < num_drafts.unsqueeze(1))
    # Leading accepts: a cumulative product stops at the first rejection (or the drafts' end).
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [num_reqs]
    rows = torch.arange(num_reqs, device=device)
    p_at = p[rows, num_accepted]  # [num_reqs, vocab] p at the first position not accepted
    rejected = num_accepted < num_drafts
    residual = p_at
    if k > 0:
        index = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_at = torch.zeros_like(p_at).scatter_(1, drafts[rows, index].unsqueeze(1), 1.0)
        else:
            q_at = draft_probs.float()[rows, index]
        leftover = (p_at - q_at).clamp_min_(0.0)
        # A rejection means q_j(x_j) > p_j(x_j), so the leftover has mass; the guard only keeps a
        # rounding accident from sampling an all-zero row.
        has_mass = leftover.sum(dim=1, keepdim=True) > 0
        residual = torch.where(rejected.unsqueeze(1) & has_mass, leftover, p_at)
    last = sample_from(residual, generator)
    tokens = torch.zeros((num_reqs, k + 1), dtype=torch.int64, device=device)
    if k > 0:
        tokens[:, :k] = torch.where(positions < num_accepted.unsqueeze(1), drafts, 0)
    tokens[rows, num_accepted] = last
    return VerifiedDrafts(tokens, num_accepted + 1)


def verify_greedy(
    target_token_ids: torch.Tensor,  # [num_reqs, max_drafts + 1] int64: the argmax at each position
    draft_token_ids: torch.Tensor,  # [num_reqs, max_drafts] int64
    num_drafts: torch.Tensor,  # [num_reqs] int64
) -> VerifiedDrafts:
    """Greedy verification: accept drafts while they equal the target's argmax, then emit the
    argmax at the first position not accepted. Does not mutate."""
    width = target_token_ids.shape[1]
    k = width - 1
    positions = torch.arange(k, device=target_token_ids.device)
    equal = (target_token_ids[:, :k] == draft_token_ids) & (positions < num_drafts.unsqueeze(1))
    num_accepted = equal.long().cumprod(dim=1).sum(dim=1)
    keep = torch.arange(width, device=target_token_ids.device) <= num_accepted.unsqueeze(1)
    return VerifiedDrafts(torch.where(keep, target_token_ids, 0), num_accepted + 1)
