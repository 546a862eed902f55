"""Investigations: scripts that each answered one question once, kept so that the measurement can
be repeated. `README.md` beside them says what each answered.

  async_overlap.py          the host time asynchronous scheduling hides (CPU, simulated device)
  offline_scheduling.py     offline throughput per scheduling policy, with profiling windows
  scheduling_model.py       the scheduling policies on a workload, steps timed by an H100 model
  host_step.py              one engine decode step's host time, by phase
  output_step.py            the front end's output work per step at 4k-token sequences, cumulative vs delta
  server_health.py          /health latency of `pagedserve serve`: idle, tokenizing 1 MB, under streams
  structured.py             structured outputs: the grammar bitmask's host cost and throughput
  fp8_accuracy.py           what FP8 costs in accuracy against bfloat16
  cascade.py                whether cascade attention pays: a shared prompt's decode step, a shared-prefix run
"""
