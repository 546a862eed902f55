"""Rejection sampling of drafts (`sampling/rejection.py`): every emitted token follows the target's
distribution, whatever the draft's. Checked with a chi-square goodness-of-fit test on a tiny
vocabulary with a fixed seed, and shown able to fail: a planted wrong acceptance rule is caught."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagedserve.sampling import rejection
from pagedserve.sampling.rejection import VerifiedDrafts, verify_drafts, verify_greedy

VOCAB = 6
# chi-square critical value for VOCAB - 1 = 5 degrees of freedom at p = 0.001
CRITICAL_5_DOF = 20.515


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _stream(
    verify: Callable[..., VerifiedDrafts], p: torch.Tensor, q: torch.Tensor | None, k: int
) -> torch.Tensor:
    """Tokens emitted by many requests of a context-free target p (the same at every position) whose
    drafts come from q (or one fixed, bad guess when q is None), counted per token id."""
    gen = torch.Generator().manual_seed(1234)
    reqs = 20_000
    target = p.expand(reqs, k + 1, VOCAB)
    if q is None:
        drafts = torch.full((reqs, k), 2, dtype=torch.int64)  # a deterministic (one-hot) proposer
        draft_probs = None
    else:
        drafts = torch.multinomial(q, reqs * k, replacement=True, generator=gen).view(reqs, k)
        draft_probs = q.expand(reqs, k, VOCAB)
    out = verify(target, drafts, torch.full((reqs,), k), draft_probs, gen)
    emitted = torch.arange(k + 1) < out.num_emitted.unsqueeze(1)
    return torch.bincount(out.token_ids[emitted], minlength=VOCAB).float()


P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.07, 0.03])
Q = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10])


@pytest.mark.parametrize("q", [Q, P, None], ids=["other_q", "q_equals_p", "one_hot_q"])
def test_emitted_tokens_follow_the_target(q: torch.Tensor | None) -> None:
    counts = _stream(verify_drafts, P, q, k=3)
    assert _chi_square(counts, P) < CRITICAL_5_DOF


def test_identical_draft_accepts_everything() -> None:
    gen = torch.Generator().manual_seed(0)
    reqs, k = 2000, 4
    drafts = torch.multinomial(P, reqs * k, replacement=True, generator=gen).view(reqs, k)
    out = verify_drafts(
        P.expand(reqs, k + 1, VOCAB), drafts, torch.full((reqs,), k), P.expand(reqs, k, VOCAB), gen
    )
    assert bool((out.num_emitted == k + 1).all())


def _accept_by_ratio_without_residual(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> VerifiedDrafts:
    """A planted bug: the right acceptance test, but a rejected position resamples from p itself
    instead of from normalize(max(0, p - q))."""
    real = rejection.sample_from
    try:
        rejection.sample_from = lambda probs, gen: real(target_probs[:, 0], gen)  # type: ignore[assignment]
        return verify_drafts(target_probs, draft_token_ids, num_drafts, draft_probs, generator)
    finally:
        rejection.sample_from = real


def test_a_wrong_rule_fails_the_goodness_of_fit_test() -> None:
    counts = _stream(_accept_by_ratio_without_residual, P, Q, k=3)
    assert _chi_square(counts, P) > CRITICAL_5_DOF


def test_variable_draft_counts_and_greedy() -> None:
    # Row 0: 2 drafts, both the argmax; row 1: 1 draft, wrong; row 2: no drafts.
    target = torch.tensor([[3, 1, 4], [2, 5, 0], [4, 0, 0]])
    drafts = torch.tensor([[3, 1], [1, 0], [0, 0]])
    out = verify_greedy(target, drafts, torch.tensor([2, 1, 0]))
    assert out.as_lists() == [[3, 1, 4], [2], [4]]
    one_hot = torch.nn.functional.one_hot(target, VOCAB).float()
    sampled = verify_drafts(one_hot, drafts, torch.tensor([2, 1, 0]), None, torch.Generator().manual_seed(0))
    assert sampled.as_lists() == [[3, 1, 4], [2], [4]]
    with pytest.raises(ValueError, match="draft_token_ids must be"):
        verify_drafts(one_hot, drafts[:, :1], torch.tensor([2, 1, 0]), None)
