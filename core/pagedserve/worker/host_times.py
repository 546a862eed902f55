"""Where a step's host time goes, for the benchmarks: seconds spent preparing and launching steps
and waiting for their outputs, with the launches grouped by the step's scheduled-token count. A
launch that grows with the step's tokens while the host work does not is a launch that waits for
the device (a full launch queue, a synchronising call); one that is long at every size is host
work. Kept by tensor-parallel ranks (`processes.tensor_parallel.worker`); the benchmarks time a
one-device runner with the same class."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TOKEN_BUCKETS: tuple[int, ...] = (64, 256, 512, 2048, 1 << 30)
"""Upper bounds (inclusive) of the scheduled-token counts launches are grouped by."""


@dataclass(slots=True)
class HostTimes:
    """Accumulated since the last `take`. Mutable; not thread-safe."""

    launch_s: float = 0.0  # preparing and queueing steps
    wait_s: float = 0.0  # waiting for launched steps' outputs
    steps: int = 0
    replied_first: int = 0  # steps whose previous output was ready when they arrived
    # bucket upper bound -> [launches, seconds]
    by_tokens: dict[int, list[float]] = field(default_factory=lambda: {b: [0, 0.0] for b in TOKEN_BUCKETS})

    def add_launch(self, num_tokens: int, seconds: float) -> None:
        """Count one launch of a `num_tokens`-token step that took `seconds`."""
        self.launch_s += seconds
        self.steps += 1
        bucket = self.by_tokens[next(b for b in TOKEN_BUCKETS if num_tokens <= b)]
        bucket[0] += 1
        bucket[1] += seconds

    def take(self) -> dict[str, Any]:
        """The totals as plain data (launch milliseconds per step by token bucket), then reset."""
        out: dict[str, Any] = {
            "launch_s": self.launch_s,
            "wait_s": self.wait_s,
            "steps": self.steps,
            "replied_first": self.replied_first,
            "launch_ms_by_tokens": {
                f"<={b}" if b < 1 << 30 else f">{TOKEN_BUCKETS[-2]}": {
                    "steps": int(n),
                    "ms_per_launch": 1e3 * s / n if n else None,
                }
                for b, (n, s) in self.by_tokens.items()
            },
        }
        fresh = HostTimes()
        self.launch_s, self.wait_s, self.steps = fresh.launch_s, fresh.wait_s, fresh.steps
        self.replied_first, self.by_tokens = fresh.replied_first, fresh.by_tokens
        return out
