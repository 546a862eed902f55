"""Speculative decoding: proposers that draft tokens for the target to verify in one step.

`proposer.Proposer` is what the engine core calls before each step (n-gram lookup, a draft model,
an EAGLE or EAGLE-3 head); the scheduler scores the drafts, the model runner verifies them
(`sampling/rejection.py`), and `metrics.SpecDecodeStats` counts what was drafted and accepted.
"""
