"""On a GPU: greedy sampling's argmax over a large vocabulary, `first_argmax` against torch.argmax.

For each batch size, one float32 logits tensor [rows, --vocab] is checked for exact equality, then
both functions are timed eagerly (host launch cost included) and replayed from a CUDA graph
(device time, as in a decode step's graph), at `first_argmax`'s own chunk width and at the
widths of `--chunks`. The numbers behind `pagedserve.sampling.argmax`'s MAX_CHUNKED_ROWS and
TARGET_CHUNK.

    python benchmarks/kernels/argmax.py --rows 1,8,64,256
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from pagedserve.sampling.argmax import first_argmax


def time_us(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, graph: bool, calls: int = 200
) -> float:
    """Mean microseconds of one `fn(x)`: eager calls, or replays of a graph holding one call."""
    fn(x)
    torch.cuda.synchronize()
    if graph:
        captured = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(x)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(captured):
            fn(x)
        run: Callable[[], object] = captured.replay
    else:
        run = lambda: fn(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    start.record()
    for _ in range(calls):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,8,16,64,256")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--chunks", default="256,1002,4008", help="chunk widths timed besides the default")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels/argmax.py needs a CUDA GPU")
    chunks = [int(c) for c in args.chunks.split(",") if c]
    print(f"{torch.cuda.get_device_name()}: argmax over [rows, {args.vocab}] float32, us per call")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, args.vocab, device="cuda")
        if not torch.equal(first_argmax(x), x.argmax(-1)):
            raise SystemExit(f"first_argmax differs from torch.argmax at {rows} rows")
        for graph in (False, True):
            mode = "graph" if graph else "eager"
            line = f"rows {rows:4d} {mode}: torch.argmax {time_us(lambda t: t.argmax(-1), x, graph):6.1f}"
            line += f" | first_argmax {time_us(first_argmax, x, graph):6.1f}"
            for chunk in chunks:
                line += f" | chunk {chunk} {time_us(lambda t, c=chunk: first_argmax(t, c), x, graph):6.1f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
