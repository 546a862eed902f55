"""Kernel micro-benchmarks: one kernel (or one step's chain of them) at a time, against the library
or the variant it competes with. On a GPU unless noted; run from the repository root, e.g.
`python benchmarks/kernels/attention.py --table`. The scripts import their neighbours here by file
name (`from attention import ...`), as when run from this folder.

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
"""
