"""Time the cpu_reference attention backend on decode batches, a prefill and a mixed batch.

Shapes are SmolLM2-135M's (9 query heads, 3 kv heads, head size 64), float32, block size 16; block
tables are shuffled so reads are not contiguous. Prints one row per case: the fastest and the median
time of one layer's attention call (on a shared machine the fastest is the better estimate of the
code's own cost), and the K/V bytes the batch covers divided by the fastest time.

    .venv/bin/python benchmarks/kernel_benchmarks/cpu_reference_attention.py [--repeats N] [--threads T]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve_cpu_reference.attention import DEFAULT_CHUNK_ELEMENTS, ReferenceAttentionBackend

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 16


@dataclass(frozen=True, slots=True)
class BenchCase:
    name: str
    query_lens: list[int]  # req index -> query_len
    seq_lens: list[int]  # req index -> seq_len


CASES = [
    BenchCase("decode 1 x ctx 256", [1], [256]),
    BenchCase("decode 1 x ctx 1024", [1], [1024]),
    BenchCase("decode 32 x ctx 256", [1] * 32, [256] * 32),
    BenchCase("decode 32 x ctx 1024", [1] * 32, [1024] * 32),
    BenchCase("decode 32 x ctx 64..1024", [1] * 32, [64 + 31 * i for i in range(32)]),
    BenchCase("prefill 1 x 512", [512], [512]),
    BenchCase("mixed: chunk 256 + 31 decodes ctx 512", [256] + [1] * 31, [768] + [512] * 31),
]


def run_case(case: BenchCase, repeats: int, chunk_elements: int) -> tuple[float, float, int]:
    """Fastest and median seconds of one forward call, and the K/V bytes the batch covers."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_req = [-(-s // BLOCK_SIZE) for s in case.seq_lens]
    num_blocks = sum(blocks_per_req)
    ids = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_req)
    table = torch.zeros(len(case.seq_lens), width, dtype=torch.int32)
    start = 0
    for req, n in enumerate(blocks_per_req):
        table[req, :n] = ids[start : start + n]
        start += n
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    metadata = AttentionMetadata.build(case.query_lens, case.seq_lens, table, BLOCK_SIZE)
    query = torch.randn(metadata.num_actual_tokens, NUM_Q_HEADS, HEAD_SIZE, generator=gen)
    out = torch.empty_like(query)
    backend = ReferenceAttentionBackend(chunk_elements)
    times = []
    for i in range(repeats + 2):  # two warm-up calls
        t0 = time.perf_counter()
        backend.forward(query, kv_cache, metadata, scale=HEAD_SIZE**-0.5, out=out)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    kv_bytes = 2 * sum(case.seq_lens) * NUM_KV_HEADS * HEAD_SIZE * kv_cache.element_size()
    return min(times), statistics.median(times), kv_bytes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per case (default 20)")
    parser.add_argument(
        "--chunk-elements",
        type=int,
        default=DEFAULT_CHUNK_ELEMENTS,
        help="the backend's memory bound per group",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, block size {BLOCK_SIZE}")
    print(f"{'case':<40} {'tokens':>6} {'min ms':>8} {'median ms':>9} {'KV GB/s':>8}")
    with torch.inference_mode():
        for case in CASES:
            fastest, median, kv_bytes = run_case(case, args.repeats, args.chunk_elements)
            tokens = sum(case.query_lens)
            print(
                f"{case.name:<40} {tokens:>6} {fastest * 1e3:>8.2f} {median * 1e3:>9.2f} "
                f"{kv_bytes / fastest / 1e9:>8.2f}"
            )


if __name__ == "__main__":
    main()
