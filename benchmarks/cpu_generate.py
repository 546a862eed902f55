"""SmolLM2-135M on this CPU: pagedserve vs HF transformers, same prompts, same run.

Measures
  * single-stream decode: one 128-token prompt, 128 greedy tokens (ignore EOS), tokens/s of the
    decode phase (TTFT reported separately);
  * batched throughput: 32 concurrent requests, 128 prompt tokens and 128 output tokens each;
  * HF transformers single-stream `generate` on the same prompt (the baseline of the targets).

    python benchmarks/cpu_generate.py [--threads N] [--dtype float32|bfloat16] [--repeats 3] [--skip-hf]
                                      [--quantization gguf] [--hf-dtype float32|bfloat16] [--cpu-compile]
                                      [--hf-process]

Both engines run in the same process, on the same prompts, in the same dtype unless `--hf-dtype`
says otherwise (`--quantization gguf` runs pagedserve with the GGUF's 4-bit blocks kept packed,
in bfloat16: HF has no such mode and dequantizes); with `--repeats R`
the measurements are interleaved (ours, HF, ours, HF, ...) and medians reported, because the
machine this runs on is shared and its load changes from minute to minute. The 1-minute load
average is recorded before and after. `--hf-process` keeps the interleaving but runs HF in a
worker process of its own: in one process, pagedserve's single-stream decode measured up to ~8%
slower once the HF model was loaded beside it (HF's own speed did not change either way).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from typing import Any

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.models.loader import default_model_source


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Avoid the first 100 ids (special and control tokens) so the text stays ordinary.
    return [torch.randint(100, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def bench_pagedserve(llm: LLM, prompt: list[int], batch: list[list[int]], out_len: int) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    engine = llm.engine
    # Warm-up (first calls allocate scratch buffers).
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine.add_request("single", prompt, params)
    t0 = time.perf_counter()
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    decode_tps = (out_len - 1) / (end - first)
    t1 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    batch_s = time.perf_counter() - t1
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "ttft_ms": (first - t0) * 1e3,
        "single_decode_tok_s": decode_tps,
        "batch_output_tok_s": n_out / batch_s,
        "batch_total_tok_s": (n_out + sum(len(p) for p in batch)) / batch_s,
        "batch_seconds": batch_s,
    }


def load_hf(dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    source = default_model_source()
    model = AutoModelForCausalLM.from_pretrained(
        str(source.directory), gguf_file=source.gguf_file, dtype=dtype
    )
    model.eval()
    return model


def bench_hf(model: Any, prompt: list[int], out_len: int) -> dict[str, float]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, min_new_tokens=1)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=out_len, do_sample=False, min_new_tokens=out_len)
        total = time.perf_counter() - t0
    return {"ttft_ms": ttft * 1e3, "single_decode_tok_s": (out_len - 1) / (total - ttft)}


class _HfWorker:
    """HF transformers in a process of its own (`--hf-process`): it loads the model once, then
    runs `bench_hf` each time it is asked, so that runs still alternate with pagedserve's while
    neither engine shares an interpreter, allocator or garbage collector with the other."""

    def __init__(self, dtype: str, threads: int | None, prompt: list[int], out_len: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_hf_worker_main, args=(child, dtype, threads, prompt, out_len))
        self._process.start()
        self._conn.recv()  # "ready": the model is loaded

    def run(self) -> dict[str, float]:
        self._conn.send("run")
        result: dict[str, float] = self._conn.recv()
        return result

    def close(self) -> None:
        self._conn.send("stop")
        self._process.join()


def _hf_worker_main(conn: Any, dtype: str, threads: int | None, prompt: list[int], out_len: int) -> None:
    if threads:
        torch.set_num_threads(threads)
    model = load_hf(getattr(torch, dtype))
    conn.send("ready")
    while conn.recv() == "run":
        conn.send(bench_hf(model, prompt, out_len))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs of both; medians reported")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--quantization", default=None, choices=["gguf"], help="pagedserve only")
    parser.add_argument("--hf-dtype", default=None, choices=["float32", "bfloat16"], help="default: --dtype")
    parser.add_argument("--cpu-compile", action="store_true", help="pagedserve only: compiled small steps")
    parser.add_argument(
        "--hf-process", action="store_true", help="run HF in its own process (runs still interleaved)"
    )
    args = parser.parse_args()
    if args.quantization is not None and args.dtype != "bfloat16":
        parser.error("--quantization gguf runs in bfloat16: add --dtype bfloat16")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    llm = LLM(
        max_model_len=512,
        max_num_seqs=args.batch,
        num_kv_blocks=args.batch * 16 + 64,
        dtype=args.dtype,
        quantization=args.quantization,
        cpu_compile=args.cpu_compile,
    )
    vocab = llm.engine.vocab_size
    prompt = _prompts(vocab, 1, args.prompt_len, seed=0)[0]
    batch = _prompts(vocab, args.batch, args.prompt_len, seed=1)
    hf_dtype = args.hf_dtype or args.dtype
    hf_model = None if args.skip_hf or args.hf_process else load_hf(getattr(torch, hf_dtype))
    hf_worker = _HfWorker(hf_dtype, args.threads, prompt, args.output_len) if args.hf_process else None
    ours_runs: list[dict[str, float]] = []
    hf_runs: list[dict[str, float]] = []
    for _ in range(args.repeats):
        ours_runs.append(bench_pagedserve(llm, prompt, batch, args.output_len))
        if hf_model is not None:
            hf_runs.append(bench_hf(hf_model, prompt, args.output_len))
        if hf_worker is not None:
            hf_runs.append(hf_worker.run())
    if hf_worker is not None:
        hf_worker.close()
    ours = _medians(ours_runs)
    result: dict[str, object] = {
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "quantization": args.quantization,
        "cpu_compile": args.cpu_compile,
        "hf_dtype": hf_dtype,
        "hf_process": args.hf_process,
        "backend": llm.engine.setup.backend.name,
        "repeats": args.repeats,
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "pagedserve": ours,
        "pagedserve_runs": ours_runs,
    }
    if hf_runs:
        hf = _medians(hf_runs)
        result["hf"] = hf
        result["hf_runs"] = hf_runs
        result["single_stream_speedup"] = ours["single_decode_tok_s"] / hf["single_decode_tok_s"]
        result["batched_vs_hf_single"] = ours["batch_output_tok_s"] / hf["single_decode_tok_s"]
    print(json.dumps(result, indent=2))


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


if __name__ == "__main__":
    main()
