"""Pieces the benchmark scripts share that are not scripts themselves.

  model_shapes.py           the mixture-of-experts shapes (Qwen3-30B-A3B, gpt-oss-20b, Mixtral-8x7B)
  set_acceptance.py         for measurement only: a proposer whose drafts the target accepts at a set rate

The GPU scripts import them as `benchmarks.common.NAME`, with the repository root on `sys.path`.
"""
