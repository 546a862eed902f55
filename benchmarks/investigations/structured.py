"""Structured outputs: the host cost of one step's grammar bitmask, and end-to-end throughput with
half the requests constrained to a JSON schema.

Bitmask cost: `--batches` (default 64 and 256) requests share one compiled JSON schema; each
matcher is first advanced into the document by a different number of tokens of a valid answer, so
the batch holds states of every kind (keys, strings, numbers, enums). Timed: one
`StructuredOutputManager.bitmask` call for the whole batch (what the engine core does every step),
with xgrammar's threaded batch fill and row by row (`threaded_fill=False`), and the sampler's
masked fill of [batch, vocab] float32 logits on the CPU. The tokenizer is SmolLM2's (49152 tokens).

Throughput: the offline engine serves `--requests` prompts twice, once unconstrained and once with
every other request constrained to the schema, `--max-tokens` each, all added at once; output
tokens per second of each run. `--model` defaults to the embedded SmolLM2-135M (GGUF).

Usage: .venv/bin/python benchmarks/investigations/structured.py [--batches 64,256] [--steps 50]
       [--requests 32] [--max-tokens 64] [--model PATH] [--skip-throughput] [--bounded-strings]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, cast

import torch

from pagedserve.models.loader import load_tokenizer
from pagedserve.sampling.grammar_mask import apply_token_bitmask
from pagedserve.structured.manager import StructuredOutputManager
from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.structured.xgrammar_backend import XGrammarBackend
from pagedserve.types import RequestId

SCHEMA = {
    "type": "object",
    "properties": {
        # No maxLength: xgrammar's masks for length-bounded strings cost milliseconds per token (a
        # slow path of the library, measured with --bounded-strings).
        "name": {"type": "string"},
        "kind": {"enum": ["cat", "dog", "bird", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "owner": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "kind", "age", "tags", "owner"],
}
ANSWER = {
    "name": "Felix the cat",
    "kind": "cat",
    "age": 7,
    "tags": ["soft", "grey"],
    "owner": {"city": "Lyon", "zip": 69001},
}


def bounded(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with every string bounded to 24 characters (xgrammar's slow path)."""
    out = json.loads(json.dumps(schema))
    out["properties"]["name"]["maxLength"] = 24
    out["properties"]["tags"]["items"]["maxLength"] = 24
    return cast(dict[str, Any], out)


def bitmask_cost(batches: list[int], steps: int, schema: dict[str, Any]) -> None:
    tokenizer = load_tokenizer(None)
    vocab = len(tokenizer)
    answer_ids = tokenizer.encode(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False)
    params = StructuredOutputsParams(json=schema)
    eos = [tokenizer.eos_token_id]
    print(f"vocab {vocab}, answer {len(answer_ids)} tokens; mean / median over {steps} steps")
    header = ("requests", "fill", "bitmask ms", "median ms", "us/request", "mask apply ms")
    print("{:>8} {:>10} {:>11} {:>10} {:>11} {:>14}".format(*header))
    for threaded in (True, False):
        manager = StructuredOutputManager(
            lambda t=threaded: XGrammarBackend(tokenizer, vocab, eos, threaded_fill=t)
        )
        for batch in batches:
            req_ids = [RequestId(f"r{threaded}-{batch}-{i}") for i in range(batch)]
            for req_id in req_ids:
                manager.submit(req_id, params)
            for i, req_id in enumerate(req_ids):
                while manager.poll(req_id) is False:
                    manager.wait_any(0.01)
                manager.accept(req_id, answer_ids[: i % (len(answer_ids) - 1)])
            manager.bitmask(req_ids, {})  # warm-up (allocates the buffer)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                mask = manager.bitmask(req_ids, {})
                times.append(time.perf_counter() - start)
            assert mask is not None
            logits = torch.randn(batch, vocab)
            apply = []
            for _ in range(max(5, steps // 5)):
                x = logits.clone()
                start = time.perf_counter()
                apply_token_bitmask(x, mask)
                apply.append(time.perf_counter() - start)
            mean = statistics.mean(times)
            print(
                f"{batch:>8} {'threaded' if threaded else 'row-by-row':>10} {mean * 1e3:>11.2f} "
                f"{statistics.median(times) * 1e3:>10.2f} {mean / batch * 1e6:>11.1f} "
                f"{statistics.median(apply) * 1e3:>14.2f}"
            )
            for req_id in req_ids:
                manager.remove(req_id)
        manager.shutdown()


def throughput(model: str | None, requests: int, max_tokens: int) -> None:
    from pagedserve import LLM, SamplingParams

    llm = LLM(model, max_model_len=512)
    prompts = [
        f"Describe pet number {i} as JSON with name, kind, age, tags and owner:" for i in range(requests)
    ]
    plain = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    constrained = SamplingParams(
        temperature=1.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    llm.generate(prompts[:2], [plain, constrained], use_tqdm=False)  # warm-up, compiles the grammar
    for label, params in (
        ("unconstrained", [plain] * requests),
        ("50% JSON schema", [constrained if i % 2 else plain for i in range(requests)]),
    ):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"{label:>16}: {tokens} output tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--bounded-strings", action="store_true", help="strings with maxLength 24")
    args = parser.parse_args()
    torch.set_num_threads(1)
    schema = bounded(SCHEMA) if args.bounded_strings else SCHEMA
    bitmask_cost([int(b) for b in args.batches.split(",")], args.steps, schema)
    if not args.skip_throughput:
        throughput(args.model, args.requests, args.max_tokens)


if __name__ == "__main__":
    main()
