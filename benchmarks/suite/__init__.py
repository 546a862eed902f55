"""The GPU suite's parts (`python -m benchmarks.gpu_suite`): the stages that live apart from it,
and its scoreboard, from the rows' vocabulary to the Today tables of docs/benchmarks.md.

  rows.py                   the scoreboard's rows and verdicts, shared by every stage's rows
  serve.py                  the serve stage: `pagedserve serve` under load beside the offline engine
  multigpu.py               the multi-GPU stage: tensor and data parallelism against one GPU
  today.py                  the Today tables of docs/benchmarks.md from a results folder
"""
