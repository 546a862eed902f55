"""`pagedserve generate "prompt"`: generate once and stream the text to the terminal."""

from __future__ import annotations

import argparse
import sys

from pagedserve.cli.engine_options import add_engine_options, engine_args_from


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("generate", help="generate text for one prompt, streaming it")
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument(
        "--model", default=None, help="checkpoint directory or .gguf (default: embedded SmolLM2)"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # Imported here so `pagedserve platforms` does not pay for torch model code.
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.outputs import RequestOutput
    from pagedserve.processes.layer import PROCESSES
    from pagedserve.sampling.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sampling_seed,
        )
    except ValueError as exc:
        print(f"pagedserve generate: {exc}", file=sys.stderr)
        return 2
    engine_args = engine_args_from(args, args.model)
    if engine_args.data_parallel_size > 1:
        print(
            "pagedserve generate: one prompt runs on one engine replica: drop --data-parallel-size "
            "(it is for `pagedserve serve` and `pagedserve bench throughput`)",
            file=sys.stderr,
        )
        return 2
    try:
        engine = LLMEngine(engine_args, processes=PROCESSES)
        prompt: str | list[int] = args.prompt
        if args.chat:
            tokenizer = engine.require_tokenizer()
            if tokenizer.chat_template is None:
                print("pagedserve generate: this model has no chat template; drop --chat", file=sys.stderr)
                return 2
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True
            )
            prompt = list(tokenizer.encode(text, add_special_tokens=False))
        engine.add_request("cli", prompt, params)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagedserve generate: {exc}", file=sys.stderr)
        return 2
    shown = 0
    finish = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if not isinstance(output, RequestOutput):
                continue  # only pooling requests' outputs are not RequestOutputs, and none was added
            text = output.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
            finish = output.outputs[0].finish_reason
    sys.stdout.write("\n")
    print(f"[{engine.setup.platform.name}, finish: {finish}]", file=sys.stderr)
    return 0
