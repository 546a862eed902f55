"""pagedserve's benchmarks: what each script is for, in the order a newcomer needs them.

Every GPU number of docs/benchmarks.md comes from one command, `python -m benchmarks.gpu_suite`
(docs/gpu_hosts.md says how to install on a GPU host); the scripts below are its stages and the
tools behind the other tables. Scripts run from the repository root (`python benchmarks/NAME.py
--help`); `workloads/` holds the two offline workloads every throughput number uses.

What a user runs: the engine against its peers
  gpu_suite.py              every GPU number and the scoreboard, peers in the same run
  gpu_suite_multigpu.py     its multi-GPU stage: tensor and data parallelism against one GPU
  scoreboard_rows.py        the scoreboard's rows and verdicts, shared by the two above
  gpu_async_scheduling.py   single stream (TTFT, TPOT), GPU idle and the decode step, default engine
  gpu_latency.py            what CUDA graphs and compilation buy; the Llama-3.1-8B shapes every GPU
                            script builds (`llama_config`, `bench_engine_args`)
  offline_scheduling.py     offline throughput per scheduling policy, with profiling windows
  gpu_fp8.py                what FP8 weights and an FP8 KV cache buy
  tp_gpu.py                 tensor parallelism: TP=N against TP=1, 8B and 70B shapes
  gpu_engine_check.py       greedy tokens on a GPU platform equal cpu_reference's
  cpu_generate.py           SmolLM2-135M on the CPU against HF transformers
  structured.py             structured outputs: the grammar bitmask's host cost and throughput
  fp8_accuracy.py           what FP8 costs in accuracy against bfloat16
  gpu_requirements.py       the requirements to download for a GPU host without internet

Kernels, one at a time (GPU unless noted)
  attention.py              the Triton attention backend's case table, prefill variants, tuning
  ragged_prefill.py         the ragged prefill kernels (Triton and Gluon) against cuDNN
  mixed_attention.py        attention of mixed steps: one launch against two
  cuda_decode_attention.py  the CUDA decode kernels against the Triton one; their thresholds
  decode_attention_splits.py  split-KV plans of small decode batches
  fp8_decode_attention_sweep.py  the decode launch grid over an FP8 cache
  decode_attention_chain.py a decode step's attention chain, plain against programmatic launches
  skinny_gemm.py            the decode step's linear layers against cuBLAS, bf16 and FP8
  gemm_backends.py          mixed-step products: cuBLAS, cuBLASLt, inductor's templates
  programmatic_launch.py    32 layers of products, plain against programmatic launches
  argmax.py                 greedy sampling's argmax over a large vocabulary
  all_reduce.py             the tensor-parallel all-reduce's paths inside CUDA graphs
  triton_host_overhead.py   host microseconds per layer of the Triton backend
  cpu_reference_attention.py  the cpu_reference backend (CPU)
  rocm_compile_table.py     the rocm platform's kernels compiled for gfx942/gfx950 (no GPU)
  kernel_fingerprint.py     the attention kernels' machine code, hashed (no GPU)

The host, without a GPU
  scheduler_step.py         one scheduler step at 256 running requests
  host_step.py              one engine decode step's host time, by phase
  async_overlap.py          the host time asynchronous scheduling hides (simulated device)
  scheduling_model.py       the scheduling policies on a workload, steps timed by an H100 model
"""
