"""pagedserve's benchmarks: what each script is for, in the order a newcomer needs them.

Every GPU number of docs/benchmarks.md comes from one command, `python -m benchmarks.gpu_suite`
(docs/gpu_hosts.md says how to install on a GPU host); the scripts below are its stages and the
tools behind the other tables. Scripts run from the repository root (`python benchmarks/NAME.py
--help`); `workloads/` holds the two offline workloads every throughput number uses.

What a user runs: the engine against its peers
  gpu_suite.py              every GPU number and the Today tables, peers in the same run
  gpu_async_scheduling.py   single stream (TTFT, TPOT), GPU idle and the decode step, default engine
  gpu_latency.py            what CUDA graphs and compilation buy; the Llama-3.1-8B shapes every GPU
                            script builds (`llama_config`, `bench_engine_args`); `--shape`
  gpu_fp8.py                what FP8 weights and an FP8 KV cache buy
  gpu_quantized.py          quantized checkpoints (W4A16, FP8) against bf16: load, memory, latency, throughput
  speculative_latency.py    single-stream TPOT with EAGLE-3 / a draft model at a set acceptance, against none
  tp_gpu.py                 tensor parallelism: TP=N against TP=1, 8B and 70B shapes
  lora_gpu.py               what 8 LoRA adapters across 64 requests cost a decode step
  serve_throughput.py       `pagedserve serve` under one or more `bench serve` loads (tok/s, latencies)
  gpu_engine_check.py       greedy tokens on a GPU platform equal cpu_reference's
  gpu_requirements.py       the requirements to download for a GPU host without internet
  cpu_generate.py           SmolLM2-135M on the CPU against HF transformers
  scheduler_step.py         one scheduler step at 256 running requests (CPU)

Folders
  suite/                    the GPU suite's serve and multi-GPU stages, its rows and Today tables
  kernel_benchmarks/        kernels, one at a time (its docstring lists each script)
  investigations/           scripts that answered one question once (its README says what each answered)
  common/                   shared pieces: the mixture-of-experts shapes, the set-acceptance proposer
  workloads/                the ShareGPT-like offline workloads of 256 and 1,000 requests
"""
