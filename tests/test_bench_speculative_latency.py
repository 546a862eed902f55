"""`benchmarks/speculative_latency.py` and its set-acceptance proposer: planted drafts are
accepted at the set rate by a verifier that keeps drafts equal to the target's tokens, and the CPU
smoke run measures every variant with the drafts it claims (none accepted where all are rejected)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from bench_support import load_benchmark

from pagedserve.spec_decode.proposer import Proposer

bench = load_benchmark("speculative_latency")
SetAcceptanceProposer = bench.SetAcceptanceProposer  # benchmarks/common/set_acceptance.py


@dataclass
class _Request:
    """What a proposer reads and writes of a scheduler request."""

    id: str
    output_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)


class _ConstantDrafts(Proposer):
    """A draft network that is always wrong in the same way: k drafts of token 0."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, requests: Sequence[_Request]) -> None:  # type: ignore[override]
        for request in requests:
            request.spec_token_ids = [0] * self.k


def _simulate(acceptance: float, k: int, steps: int, vocab: int = 50) -> tuple[int, int, int, float]:
    """Greedy verification against a known output: (accepted, reached, drafted, tokens per step)."""
    rng = random.Random(1)
    truth = [rng.randrange(1, vocab) for _ in range(steps * (k + 1) + 1)]
    proposer = SetAcceptanceProposer(_ConstantDrafts(k), acceptance, vocab, seed=3)
    proposer.expect("r", truth)
    request = _Request("r", output_token_ids=truth[:1])
    accepted = reached = drafted = 0
    for _ in range(steps):
        proposer.propose([request])
        n = len(request.output_token_ids)
        drafts = request.spec_token_ids
        kept = 0
        while kept < len(drafts) and drafts[kept] == truth[n + kept]:
            kept += 1
        accepted += kept
        reached += min(kept + 1, len(drafts))
        drafted += len(drafts)
        request.output_token_ids = truth[: n + kept + 1]  # the accepted drafts, then the target's token
    return accepted, reached, drafted, (len(request.output_token_ids) - 1) / steps


def test_planted_drafts_are_accepted_at_the_set_rate() -> None:
    accepted, reached, _, per_step = _simulate(0.7, k=3, steps=2000)
    assert abs(accepted / reached - 0.7) < 0.03
    # The chain model's tokens per step: (1 - a^(k+1)) / (1 - a) = 2.533 at a = 0.7, k = 3.
    assert abs(per_step - (1 - 0.7**4) / 0.3) < 0.08


def test_every_planted_draft_is_rejected_at_zero_and_accepted_at_one() -> None:
    accepted, reached, drafted, per_step = _simulate(0.0, k=3, steps=200)
    assert accepted == 0 and reached == 200 and drafted == 600 and per_step == 1.0
    accepted, _, drafted, per_step = _simulate(1.0, k=3, steps=200)
    assert accepted == drafted == 600 and per_step == 4.0


def test_acceptance_outside_zero_one_is_refused() -> None:
    with pytest.raises(ValueError, match="acceptance must be in"):
        SetAcceptanceProposer(_ConstantDrafts(1), 1.5, 50)


def test_acceptance_holds_allows_chance_only() -> None:
    assert bench.acceptance_holds(0.7, 60, 100) and not bench.acceptance_holds(0.7, 40, 100)
    assert bench.acceptance_holds(0.0, 0, 30) and not bench.acceptance_holds(0.0, 1, 30)
    assert not bench.acceptance_holds(0.7, 0, 0)


def test_cpu_smoke_measures_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "speculative.json"
    results = bench.main(["--cpu-smoke", "--fixed-k", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    variants = results["variants"]
    assert list(variants) == list(bench.VARIANTS)
    assert variants["baseline"]["tpot_ms"] > 0 and variants["baseline"]["drafted"] == 0
    for name in ("eagle3_k3_p0.7", "draft_1b_k4_p0.7", "eagle3_k3_rejected"):
        result = variants[name]
        assert result["expected_tokens_held"], name
        assert result["tpot_ms"] > 0 and result["drafted"] > 0, name
        assert result["judged"]["verdict"] in ("met", "missed"), (name, result["judged"])
        assert result["judged"]["tpot_ratio"] == pytest.approx(
            result["tpot_ms"] / variants["baseline"]["tpot_ms"]
        )
    rejected = variants["eagle3_k3_rejected"]
    assert rejected["accepted"] == 0 and rejected["tokens_per_decode_step"] == 1.0
    for name in ("eagle3_k3_p0.7", "draft_1b_k4_p0.7"):
        result = variants[name]
        assert abs(result["acceptance_measured"] - 0.7) < 0.2, (name, result["acceptance_measured"])
        assert result["tokens_per_decode_step"] > 1.5, name  # accepted drafts made steps longer
