"""Kernel micro-benchmarks: one kernel (or one step's chain of them) at a time, against the library
or the variant it competes with. On a GPU unless noted; run from the repository root, e.g.
`python benchmarks/kernel_benchmarks/attention.py --table`. The scripts import their neighbours here by file
name (`from attention_batches import ...`), as when run from this folder.

  attention.py              the Triton attention backend's case table, prefill variants, tuning;
                            its modes are the attention_*.py modules below
  attention_batches.py      shapes, batches in a paged cache, the backend under test and its call
  attention_grid.py         attention.py's default decode grid, and --tune
  attention_cases.py        the case table's cases, goals and arithmetic (no GPU)
  attention_baselines.py    SDPA and FlexAttention on contiguous copies; timing one call
  attention_table.py        attention.py --table
  attention_variants.py     attention.py --variants
  attention_configs.py      tuned-config files for sweeps, and the variants' winners written
  timing.py                 CUDA-graph and CUDA-event timing, shared by every script here
  ragged_prefill.py         the ragged prefill kernels (Triton and Gluon) against cuDNN
  cuda_decode_attention.py  the CUDA decode kernels against the Triton one; their thresholds
  decode_attention_splits.py  split-KV plans of small decode batches
  fp8_decode_attention_sweep.py  the decode launch grid over an FP8 cache
  moe_op.py                 the fused MoE op against torch._grouped_mm and its memory bound
  moe_tune.py               a search of the fused MoE op's launch configs, winners as tuned-config entries
  int_gemm.py               the integer-weight GEMM against cuBLAS bf16 and its bound; --sweep tunes its tiles
  skinny_gemm.py            the decode step's linear layers against cuBLAS, bf16 and FP8
  programmatic_launch.py    32 layers of products, plain against programmatic launches
  all_reduce.py             the tensor-parallel all-reduce's paths inside CUDA graphs
  triton_host_overhead.py   host microseconds per layer of the Triton backend
  cpu_reference_attention.py  the cpu_reference backend (CPU)
  rocm_compile_table.py     the rocm platform's kernels compiled for gfx942/gfx950 (no GPU)
  kernel_fingerprint.py     the attention kernels' machine code, hashed (no GPU)

Retired, their answers now in the code (revision bb43c45 still has them): mixed_attention (mixed
steps in one launch), decode_attention_chain (attention's programmatic launches), gemm_backends
(cuBLASLt and inductor's templates for mixed-step products) and argmax (greedy sampling's argmax).
"""
