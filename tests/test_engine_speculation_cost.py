"""The speculation cost model: drafts at small batches, none where extra tokens cost as much as
real ones, and none once the drafts stop being accepted."""

from __future__ import annotations

from pagedserve.spec_decode.cost_model import SpeculationCostModel


def _measured(overhead: float, per_token: float, draft: float, acceptance: float) -> SpeculationCostModel:
    model = SpeculationCostModel()
    for n in (1, 4, 16, 64, 256, 1024, 2, 8, 32, 128):
        model.observe_target(n, overhead + per_token * n)
    model.observe_draft(10, 3, draft * 30)
    model.observe_acceptance(10_000, int(10_000 * acceptance))
    return model


def test_drafts_where_the_step_is_overhead_bound_and_not_under_load() -> None:
    model = _measured(overhead=10e-3, per_token=20e-6, draft=0.3e-3, acceptance=0.7)
    assert model.choose(1, 4) >= 2
    assert model.choose(512, 4) == 0


def test_no_drafts_when_nothing_is_accepted() -> None:
    model = _measured(overhead=10e-3, per_token=20e-6, draft=0.3e-3, acceptance=0.0)
    assert model.choose(1, 4) == 0


def test_priors_draft_at_small_batches_before_anything_is_measured() -> None:
    assert SpeculationCostModel().choose(1, 3) > 0
