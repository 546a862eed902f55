"""pagedserve's benchmarks: what each script is for, in the order a newcomer needs them.

Every GPU number of docs/benchmarks.md comes from one command, `python -m benchmarks.gpu_suite`
(docs/gpu_hosts.md says how to install on a GPU host); the scripts below are its stages and the
tools behind the other tables. Scripts run from the repository root (`python benchmarks/NAME.py
--help`, `python benchmarks/kernel_benchmarks/NAME.py --help`); `workloads/` holds the two offline workloads
every throughput number uses.

What a user runs: the engine against its peers
  gpu_suite.py              every GPU number and the scoreboard, peers in the same run
  gpu_suite_multigpu.py     its multi-GPU stage: tensor and data parallelism against one GPU
  gpu_suite_serve.py        its serve stage: `pagedserve serve` under load beside the offline engine
  scoreboard_rows.py        the scoreboard's rows and verdicts, shared by the two above
  gpu_async_scheduling.py   single stream (TTFT, TPOT), GPU idle and the decode step, default engine
  gpu_latency.py            what CUDA graphs and compilation buy; the Llama-3.1-8B shapes every GPU
                            script builds (`llama_config`, `bench_engine_args`); `--shape`
  model_shapes.py           the mixture-of-experts shapes (Qwen3-30B-A3B, gpt-oss-20b, Mixtral-8x7B)
  offline_scheduling.py     offline throughput per scheduling policy, with profiling windows
  gpu_fp8.py                what FP8 weights and an FP8 KV cache buy
  gpu_quantized.py          quantized checkpoints (W4A16, FP8) against bf16: load, memory, latency, throughput
  tp_gpu.py                 tensor parallelism: TP=N against TP=1, 8B and 70B shapes
  lora_gpu.py               what 8 LoRA adapters across 64 requests cost a decode step
  serve_throughput.py       `pagedserve serve` under one or more `bench serve` loads (tok/s, latencies)
  gpu_engine_check.py       greedy tokens on a GPU platform equal cpu_reference's
  cpu_generate.py           SmolLM2-135M on the CPU against HF transformers
  structured.py             structured outputs: the grammar bitmask's host cost and throughput
  fp8_accuracy.py           what FP8 costs in accuracy against bfloat16
  gpu_requirements.py       the requirements to download for a GPU host without internet

Kernels, one at a time: the package `kernel_benchmarks/` (its docstring lists each script)

The host, without a GPU
  scheduler_step.py         one scheduler step at 256 running requests
  host_step.py              one engine decode step's host time, by phase
  output_step.py            the front end's output work per step at 4k-token sequences, cumulative vs delta
  async_overlap.py          the host time asynchronous scheduling hides (simulated device)
  scheduling_model.py       the scheduling policies on a workload, steps timed by an H100 model
  server_health.py          /health latency of `pagedserve serve`: idle, tokenizing 1 MB, under streams
"""
