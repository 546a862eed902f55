"""`HostTimes`: launches counted by the step's scheduled-token bucket, and reset when taken."""

from __future__ import annotations

import pytest

from pagedserve.worker.host_times import HostTimes


def test_launches_are_grouped_by_token_count_and_reset_when_taken() -> None:
    times = HostTimes()
    times.add_launch(1, 0.001)
    times.add_launch(64, 0.003)
    times.add_launch(65, 0.010)
    times.add_launch(100_000, 0.050)
    times.wait_s += 0.5
    times.replied_first += 2
    out = times.take()
    assert out["steps"] == 4 and out["replied_first"] == 2 and out["wait_s"] == 0.5
    assert out["launch_s"] == pytest.approx(0.064)
    by = out["launch_ms_by_tokens"]
    assert by["<=64"] == {"steps": 2, "ms_per_launch": pytest.approx(2.0)}
    assert by["<=256"] == {"steps": 1, "ms_per_launch": pytest.approx(10.0)}
    assert by["<=512"] == {"steps": 0, "ms_per_launch": None}
    assert by[">2048"] == {"steps": 1, "ms_per_launch": pytest.approx(50.0)}
    again = times.take()
    assert again["steps"] == 0 and again["launch_s"] == 0.0
    assert all(b["steps"] == 0 for b in again["launch_ms_by_tokens"].values())
