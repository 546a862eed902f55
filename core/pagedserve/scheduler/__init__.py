"""The V1 scheduler: requests, the per-step token budget, and the scheduler -> worker contract.
See docs/scheduler.md."""
