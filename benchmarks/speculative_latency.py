"""Single-stream decode latency with speculative decoding, against the same engine without it, in
one run: Llama-3.1-8B shapes, dummy bfloat16 weights, one prompt of 512 tokens, 128 out.

Variants (`--variants`, by name) and the targets they are judged by (TPOT over the baseline's):

  baseline            no speculation (every ratio's denominator)
  eagle3_k3_p0.7      an EAGLE-3 head, k=3, set acceptance 0.7        goal <= 0.5x
  draft_1b_k4_p0.7    a Llama-3.2-1B-shaped draft model, k=4, 0.7     goal <= 0.6x
  eagle3_k3_rejected  the EAGLE-3 head, k=3, every draft rejected     goal <= 1.05x

Random weights make a draft agree with the target almost never, so the acceptance is set:
`common/set_acceptance.py` lets the draft network run as it would, then replaces its tokens with
the target's own greedy tokens (accepted, each draft whose predecessors were accepted with the set
probability) or another token (rejected); the engine verifies them as always. The target's tokens
come from the baseline's run of the same prompt (lossless drafting emits the same greedy tokens);
if a timed run's output differs from them (a bfloat16 argmax flipped between differently shaped
steps), it becomes the new expectation and the run is repeated, at most `--max-calibrations`
times per variant (the JSON says whether the expectation held). Each engine's first run of the
prompt is its warm-up, untimed in the results.

Each variant is its own engine, built, measured and freed in turn, prefix caching off (every
run repeats one prompt). TTFT is the first step; TPOT the decode steps' seconds (synchronised)
over the tokens after the first, the median of `--repeats` runs. The engine chooses how many of
its k drafts to score per step (`spec_decode/cost_model.py`) as when serving; `--fixed-k`
drafts k every step. A verdict is `met` or `missed`, or `invalid` when the measured acceptance is
further from the set one than chance explains (three binomial standard deviations; any accepted
draft where all are rejected) or no run's output was what was planted.

    python benchmarks/speculative_latency.py --platform cuda --json speculative.json
    python benchmarks/speculative_latency.py --cpu-smoke --json smoke.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its neighbours, as the other GPU scripts
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from gpu_latency import _prompt, bench_engine_args, llama_config

from benchmarks.common.set_acceptance import SetAcceptanceProposer, install
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Variant:
    """One engine measured: how it drafts, at which set acceptance, and its goal."""

    name: str
    method: str | None  # a speculative_config method; None: no speculation (the baseline)
    k: int  # num_speculative_tokens; 0 for the baseline
    acceptance: float | None  # the set acceptance per draft; None for the baseline
    goal_ratio: float | None  # TPOT / baseline TPOT at most this; None for the baseline


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("baseline", None, 0, None, None),
        Variant("eagle3_k3_p0.7", "eagle3", 3, 0.7, 0.5),
        Variant("draft_1b_k4_p0.7", "draft_model", 4, 0.7, 0.6),
        Variant("eagle3_k3_rejected", "eagle3", 3, 0.0, 1.05),
    )
}


@dataclass(frozen=True, slots=True)
class Models:
    """The config directories of a `--shape`: the target and its two drafts."""

    target: Path
    draft_model: Path  # a smaller causal LM with the target's vocabulary
    eagle3: Path  # an EAGLE-3 head over the target
    vocab_size: int


def _tiny_llama(num_layers: int) -> LlamaConfig:
    """The smoke shape: a few KiB of weights, quick on two CPU cores."""
    return LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )


def _draft_1b() -> LlamaConfig:
    """Llama-3.2-1B's layers (16 of hidden 2048, heads of 64) with Llama-3.1's vocabulary."""
    config = llama_config("8b")
    config.update(
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            head_dim=64,
        )
    )
    return config


def write_models(shape: str, root: Path) -> Models:
    """Write the config files of `shape` (`llama-8b` or `tiny`) under `root`; dummy weights fill
    them when the engine loads."""
    target, draft = (
        (llama_config("8b"), _draft_1b()) if shape == "llama-8b" else (_tiny_llama(4), _tiny_llama(1))
    )
    # An EAGLE-3 head is one decoder layer of the target's width with a smaller draft vocabulary
    # (32,000 of 128,256 tokens in the published Llama-3.1-8B heads).
    head = target.to_dict() | {
        "num_hidden_layers": 1,
        "architectures": ["Eagle3LlamaForCausalLM"],
        "draft_vocab_size": 32000 if shape == "llama-8b" else 256,
    }
    models = Models(root / "target", root / "draft_model", root / "eagle3", target.vocab_size)
    target.save_pretrained(models.target)
    draft.save_pretrained(models.draft_model)
    models.eagle3.mkdir(parents=True)
    (models.eagle3 / "config.json").write_text(json.dumps(head))
    return models


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass(frozen=True, slots=True)
class Run:
    """One timed request from prompt to its last token."""

    output: list[int]  # the generated tokens
    step_s: list[float]  # seconds of each step, synchronised; [0] is the prefill
    drafted: list[int]  # drafts scored per step
    accepted: list[int]  # drafts accepted per step


def timed_run(engine: LLMEngine, req_id: str, prompt: list[int], params: SamplingParams) -> Run:
    """Run one request alone to its end, timing each step and counting its drafts."""
    engine.add_request(req_id, prompt, params)
    core = engine.core
    step_s, drafted, accepted = [], [], []
    output: list[int] = []
    before = core.spec_decode_counts()
    while engine.has_unfinished_requests():
        _sync()
        start = time.perf_counter()
        outs = engine.step()
        _sync()
        step_s.append(time.perf_counter() - start)
        now = core.spec_decode_counts()
        drafted.append(now.num_draft_tokens - before.num_draft_tokens)
        accepted.append(now.num_accepted_tokens - before.num_accepted_tokens)
        before = now
        for out in outs:
            if out.finished:
                output = list(out.outputs[0].token_ids)
    return Run(output, step_s, drafted, accepted)


def summarize(run: Run) -> dict[str, Any]:
    """TTFT, TPOT and acceptance of a run. Pure.

    The set acceptance is per draft reached (its predecessors accepted), so it is measured as
    accepted / (accepted + the rejections that ended a step's drafts); accepted / scored is
    vLLM's acceptance rate, lower, as every draft after a rejection counts as scored too."""
    decode = run.step_s[1:]
    tokens_after_first = len(run.output) - 1
    accepted, drafted = sum(run.accepted), sum(run.drafted)
    reached = sum(min(a + 1, d) for a, d in zip(run.accepted, run.drafted, strict=True))
    return {
        "ttft_ms": run.step_s[0] * 1e3,
        "tpot_ms": sum(decode) * 1e3 / tokens_after_first,
        "decode_steps": len(decode),
        "output_tokens": len(run.output),
        "tokens_per_decode_step": tokens_after_first / len(decode),
        "drafts_per_decode_step": drafted / len(decode),
        "drafted": drafted,
        "accepted": accepted,
        "reached": reached,
        "acceptance_per_draft_reached": accepted / reached if reached else None,
        "acceptance_per_draft_scored": accepted / drafted if drafted else None,
    }


def _engine(variant: Variant, models: Models, args: argparse.Namespace) -> LLMEngine:
    options: dict[str, Any] = {
        "dtype": args.dtype,
        "num_kv_blocks": args.num_kv_blocks,
        "enable_prefix_caching": False,
    }
    if variant.method is not None:
        draft = models.eagle3 if variant.method == "eagle3" else models.draft_model
        options["speculative_config"] = {
            "method": variant.method,
            "model": str(draft),
            "num_speculative_tokens": variant.k,
        }
    return LLMEngine(bench_engine_args(str(models.target), args.platform, **options))


def measure(
    variant: Variant, models: Models, args: argparse.Namespace, expected: list[int] | None
) -> tuple[dict[str, Any], list[int]]:
    """Build `variant`'s engine, run the prompt once (the warm-up), then `args.repeats` timed
    runs; free the engine. Drafts are planted from `expected`, the baseline's greedy tokens
    (None: the baseline itself, which plants nothing). Returns the results and the greedy tokens
    of the warm-up."""
    engine = _engine(variant, models, args)
    prompt = [token % models.vocab_size for token in _prompt(args.prompt_len, 2)]  # the tiny vocabulary too
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0, detokenize=False)
    wrapper: SetAcceptanceProposer | None = None
    if variant.acceptance is not None:
        if args.fixed_k:
            inner = engine.core.proposer
            if hasattr(inner, "cost_model"):
                inner.cost_model = None  # draft k every step
        wrapper = install(engine.core, variant.acceptance, models.vocab_size, seed=args.seed)
    # The warm-up plants from the baseline's tokens too: drafts that the target rejects for want of
    # an expectation would teach the cost model an acceptance of 0.
    if wrapper is not None:
        assert expected is not None, "the baseline runs first"
        wrapper.expect(f"{variant.name}-warm", expected)
    warm = timed_run(engine, f"{variant.name}-warm", prompt, params).output
    expected = warm if expected is None else expected
    runs: list[dict[str, Any]] = []
    calibrations = 0
    while len(runs) < args.repeats and calibrations <= args.max_calibrations:
        req_id = f"{variant.name}-{len(runs)}-{calibrations}"
        if wrapper is not None:
            wrapper.expect(req_id, expected)
            wrapper.restart(args.seed + len(runs))  # each run its own draws, replayed on a retry
        run = timed_run(engine, req_id, prompt, params)
        if wrapper is not None and run.output != expected:
            # The target's greedy tokens moved under other step shapes (a bfloat16 argmax that
            # flipped), so some planted drafts were not what the target emits: plant the new
            # tokens and run again. A run whose output is what was planted planted only truths.
            expected = run.output
            calibrations += 1
            continue
        runs.append(summarize(run))
    out: dict[str, Any] = {
        "variant": asdict(variant),
        "runs": runs,
        "expected_tokens_held": len(runs) == args.repeats,
        "calibrations": calibrations,
    }
    if runs:
        out |= {
            key: statistics.median(r[key] for r in runs)
            for key in ("ttft_ms", "tpot_ms", "tokens_per_decode_step", "drafts_per_decode_step")
        }
        for key in ("drafted", "accepted", "reached"):
            out[key] = sum(r[key] for r in runs)
        out["acceptance_measured"] = out["accepted"] / out["reached"] if out["reached"] else None
    del engine, wrapper
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out, warm


def acceptance_holds(set_rate: float, accepted: int, reached: int) -> bool:
    """Whether `accepted` of `reached` drafts is the set rate up to chance: none accepted at 0, all
    at 1, else within three binomial standard deviations. Pure."""
    if set_rate in (0.0, 1.0):
        return accepted == set_rate * reached
    return reached > 0 and abs(accepted / reached - set_rate) <= 3 * math.sqrt(
        set_rate * (1 - set_rate) / reached
    )


def verdict(result: dict[str, Any], baseline_tpot_ms: float) -> dict[str, Any]:
    """The ratio to the baseline and whether the variant met its goal. Pure."""
    variant = result["variant"]
    ratio = result["tpot_ms"] / baseline_tpot_ms
    set_rate = variant["acceptance"]
    if not result["expected_tokens_held"]:
        why = "invalid: the target's greedy tokens kept changing between runs"
    elif not acceptance_holds(set_rate, result["accepted"], result["reached"]):
        why = f"invalid: {result['accepted']} of {result['reached']} drafts accepted, set {set_rate}"
    else:
        why = "met" if ratio <= variant["goal_ratio"] else "missed"
    return {"tpot_ratio": ratio, "goal_ratio": variant["goal_ratio"], "verdict": why}


def table(results: dict[str, Any]) -> str:
    """The printed summary: one row per variant. Pure."""
    columns = ("TPOT ms", 9), ("ratio", 6), ("goal", 6), ("accept set/meas", 16), ("tok/step", 8)
    rows = [f"{'variant':<20} " + " ".join(f"{title:>{width}}" for title, width in columns) + "  verdict"]
    for name, r in results["variants"].items():
        judged = r.get("judged", {})
        set_rate = r["variant"]["acceptance"]
        measured = r.get("acceptance_measured")
        accept = (
            "-" if set_rate is None else f"{set_rate:.2f}/" + ("-" if measured is None else f"{measured:.2f}")
        )
        ratio = judged.get("tpot_ratio")
        goal = judged.get("goal_ratio")
        rows.append(
            f"{name:<20} {r.get('tpot_ms', float('nan')):>9.3f} "
            f"{'-' if ratio is None else f'{ratio:.3f}':>6} {'-' if goal is None else f'<={goal}':>6} "
            f"{accept:>16} {r.get('tokens_per_decode_step', float('nan')):>8.2f}  {judged.get('verdict', '')}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--platform", default="triton", help="cuda, triton or cpu_reference")
    parser.add_argument(
        "--shape", default="llama-8b", choices=("llama-8b", "tiny"), help="model shapes (random weights)"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant (their median)")
    parser.add_argument(
        "--max-calibrations", type=int, default=4, help="re-runs after the expected tokens moved"
    )
    parser.add_argument(
        "--num-kv-blocks", type=int, default=8192, help="the target's KV blocks (as gpu_latency.py)"
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS)
    )
    parser.add_argument("--fixed-k", action="store_true", help="draft k every step (the cost model off)")
    parser.add_argument("--seed", type=int, default=0, help="of the accept/reject draws")
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="the tiny shape on cpu_reference in float32, 32 -> 32 tokens, one run: checks the script",
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.platform, args.shape, args.dtype = "cpu_reference", "tiny", "float32"
        args.prompt_len, args.output_len, args.repeats, args.num_kv_blocks = 32, 32, 1, 256
    if args.output_len < 2 or args.repeats < 1 or args.prompt_len < 1:
        raise SystemExit("need --output-len >= 2 (TPOT is over the tokens after the first), --repeats >= 1")
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}; the variants are {', '.join(VARIANTS)}")
    # The baseline runs first, always: every ratio is to it, and its tokens are the ones planted.
    names = ["baseline", *(n for n in names if n != "baseline")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results: dict[str, Any] = {"device": device, "args": vars(args), "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        models = write_models(args.shape, Path(tmp))
        expected: list[int] | None = None  # the baseline's greedy tokens, once it ran
        for name in names:
            results["variants"][name], warm = measure(VARIANTS[name], models, args, expected)
            expected = warm if expected is None else expected
            print(json.dumps({name: results["variants"][name]}, default=str), flush=True)
    baseline = results["variants"]["baseline"]["tpot_ms"]
    for name in names:
        result = results["variants"][name]
        if name == "baseline":
            continue
        if "tpot_ms" in result:
            result["judged"] = verdict(result, baseline)
        else:
            result["judged"] = {"verdict": "invalid: the target's greedy tokens kept changing between runs"}
    print(table(results), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
