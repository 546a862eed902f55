"""`LLM.beam_search` on cpu_reference: HF transformers' beam search where the two rules agree,
greedy decoding at beam_width=1, one engine batch per step with the beams' prefixes cached, EOS
handling and length penalty on scripted logprobs, and the argument errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models_harness import random_prompts, save_checkpoint, tiny_hf_model
from server_support import build_tiny_model
from transformers import LlamaConfig, PreTrainedModel

from pagedserve import LLM, SamplingParams
from pagedserve.beam_search import BeamSearchOutput, beam_search_score, run_beam_search
from pagedserve.inputs import PromptType, TextPrompt, TokensPrompt
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import BeamSearchParams

VOCAB = 96
EOS = 3


def _config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=EOS,
    )


@pytest.fixture(scope="module")
def hf_model() -> PreTrainedModel:
    return tiny_hf_model(_config(), seed=11)


@pytest.fixture(scope="module")
def checkpoint(hf_model: PreTrainedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> LLM:
    return LLM(str(checkpoint), skip_tokenizer_init=True, dtype="float32", max_model_len=64, block_size=4)


PROMPTS = random_prompts(VOCAB, [9, 14, 5], seed=3)


def _hf_beams(
    model: PreTrainedModel, prompt: list[int], width: int, max_tokens: int, length_penalty: float
) -> tuple[list[list[int]], list[float]]:
    """HF's beam search without an EOS token: every beam runs max_tokens, so its per-step choice
    (the best `width` of the top 2*width continuations) and its final ranking are vLLM's."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        generate: Any = model.generate  # transformers' stubs type it as a module attribute
        out: Any = generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=True,
            output_scores=True,
            return_dict_in_generate=True,
        )
    return out.sequences.tolist(), out.sequences_scores.tolist()


@pytest.mark.parametrize(("width", "max_tokens", "length_penalty"), [(3, 6, 1.0), (4, 5, 0.0), (2, 7, 2.0)])
def test_matches_hf_beam_search_without_eos(
    llm: LLM, hf_model: PreTrainedModel, width: int, max_tokens: int, length_penalty: float
) -> None:
    params = BeamSearchParams(
        beam_width=width, max_tokens=max_tokens, ignore_eos=True, length_penalty=length_penalty
    )
    outputs = llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params)
    assert len(outputs) == len(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        sequences, scores = _hf_beams(hf_model, prompt, width, max_tokens, length_penalty)
        assert [s.tokens for s in output.sequences] == sequences
        # HF scores over the generated length; every beam has max_tokens of them.
        hf_cum = [score * max_tokens**length_penalty for score in scores]
        assert [s.cum_logprob for s in output.sequences] == pytest.approx(hf_cum, abs=1e-4)
        for seq in output.sequences:
            assert seq.finish_reason == "length"
            assert seq.text is None  # no tokenizer
            assert len(seq.logprobs) == max_tokens
            chosen = [
                step[t].logprob for step, t in zip(seq.logprobs, seq.tokens[len(prompt) :], strict=True)
            ]
            assert sum(chosen) == pytest.approx(seq.cum_logprob, abs=1e-5)


def test_width_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate(
        PROMPTS,
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, detokenize=False),
        use_tqdm=False,
    )
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    for prompt, g, b in zip(PROMPTS, greedy, beams, strict=True):
        (seq,) = b.sequences
        assert seq.tokens == prompt + g.outputs[0].token_ids
        assert seq.cum_logprob == pytest.approx(g.outputs[0].cumulative_logprob, abs=1e-5)


def test_one_batch_per_step_with_every_beam_and_cached_prefixes(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches: list[list[RequestOutput]] = []
    run = llm._run

    def recording(prompts: Any, params: Any, use_tqdm: bool) -> list[RequestOutput]:
        outputs = run(prompts, params, use_tqdm)
        batches.append(outputs)
        return outputs

    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    alone = [llm.beam_search([p], params)[0] for p in PROMPTS]
    monkeypatch.setattr(llm, "_run", recording)
    together = llm.beam_search(PROMPTS, params)
    _same(together, alone)
    assert [len(b) for b in batches] == [3, 9, 9, 9, 9]  # one beam per prompt, then 3 each
    # From the second step on, every beam's full blocks (4 tokens) were computed before.
    for outputs in batches[1:]:
        for out in outputs:
            assert out.num_cached_tokens >= (len(out.prompt_token_ids) - 1) // 4 * 4 - 4
    assert sum(out.num_cached_tokens for out in batches[-1]) > 0


def _same(a: list[BeamSearchOutput], b: list[BeamSearchOutput]) -> None:
    assert [[s.tokens for s in o.sequences] for o in a] == [[s.tokens for s in o.sequences] for o in b]
    for x, y in zip(a, b, strict=True):
        assert [s.cum_logprob for s in x.sequences] == pytest.approx(
            [s.cum_logprob for s in y.sequences], abs=1e-4
        )


def test_text_prompts_and_text(tmp_path: Path) -> None:
    llm = LLM(str(build_tiny_model(tmp_path)), dtype="float32", max_model_len=64)
    tokenizer = llm.get_tokenizer()
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    mixed: list[PromptType] = [TextPrompt(prompt="Hello there"), "Once upon"]
    by_text = llm.beam_search(mixed, params)
    by_ids = llm.beam_search([TokensPrompt(prompt_token_ids=tokenizer.encode("Hello there"))], params)
    assert [s.tokens for s in by_text[0].sequences] == [s.tokens for s in by_ids[0].sequences]
    for seq in by_text[1].sequences:
        assert seq.text is not None and seq.text == tokenizer.decode(seq.tokens)
        assert seq.text.startswith("Once upon")


# ---- the search rules on scripted logprobs ----------------------------------------------------


def _scripted(table: dict[tuple[int, ...], dict[int, float]], calls: list[int]) -> Any:
    """A `run_batch` whose next-token logprobs come from `table`, keyed by the whole sequence, cut
    to the `logprobs` best as the engine cuts them."""

    def run_batch(batch: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        calls.append(len(batch))
        outs = []
        for tokens in batch:
            assert params.logprobs is not None
            ranked = sorted(table[tuple(tokens)].items(), key=lambda item: -item[1])[: params.logprobs]
            top = {t: Logprob(lp, rank) for rank, (t, lp) in enumerate(ranked, 1)}
            completion = CompletionOutput(0, "", [next(iter(top))], None, [top], "length")
            outs.append(RequestOutput("r", None, tokens, None, [completion], True))
        return outs

    return run_batch


def test_eos_candidates_complete_and_length_penalty_ranks() -> None:
    # Prompt [1]. Step 1: 5 then EOS. From [1, 5]: 6 then EOS; from [1, 3] nothing (completed).
    table = {
        (1,): {5: -0.1, EOS: -0.5, 7: -3.0},
        (1, 5): {6: -0.2, EOS: -2.0, 8: -4.0},
        (1, 7): {9: -0.1, EOS: -0.1, 8: -0.3},
        (1, 5, 6): {10: -0.3, 11: -1.0},
        (1, 7, 8): {10: -0.3, 11: -1.0},
        (1, 7, 9): {10: -0.3, 11: -1.0},
        (1, 5, 8): {10: -0.3, 11: -1.0},
    }
    calls: list[int] = []
    text = " ".join

    def decode(ids: list[int]) -> str:
        return text(map(str, ids))

    # No length penalty: raw sums rank, and [1, EOS] (-0.5) beats [1, 5, 6, 10] (-0.6).
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0)
    (flat,) = run_beam_search([[1]], params, _scripted(table, calls), {EOS}, decode)
    assert calls == [1, 2, 2]  # EOS candidates never take a live place
    assert [(s.tokens, s.finish_reason) for s in flat.sequences] == [
        ([1, EOS], "stop"),
        ([1, 5, 6, 10], "length"),
    ]
    assert [s.text for s in flat.sequences] == ["1", "1 5 6 10"]  # the EOS token's text left out
    assert flat.sequences[1].cum_logprob == pytest.approx(-0.6)
    # Length penalty 1: [1, 5, 6, 10] scores -0.6 / 4 and [1, 5, 6, 11] -1.3 / 4, both above -0.5 / 1.
    (long,) = run_beam_search(
        [[1]], BeamSearchParams(beam_width=2, max_tokens=3), _scripted(table, []), {EOS}, None
    )
    assert [s.tokens for s in long.sequences] == [[1, 5, 6, 10], [1, 5, 6, 11]]
    assert long.sequences[0].text is None
    # A final EOS is not counted in the length; the prompt is.
    assert beam_search_score([1, 2, EOS], -1.0, {EOS}, 1.0) == pytest.approx(-0.5)
    assert beam_search_score([1, 2, 4], -1.0, {EOS}, 1.0) == pytest.approx(-1 / 3)
    assert beam_search_score([1, 2, 4], -1.0, {EOS}, 2.0) == pytest.approx(-1 / 9)
    # include_stop_str_in_output keeps the EOS token's text.
    (kept,) = run_beam_search(
        [[1]],
        BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0, include_stop_str_in_output=True),
        _scripted(table, []),
        {EOS},
        decode,
    )
    assert kept.sequences[0].text == f"1 {EOS}"
    # ignore_eos: EOS is an ordinary token and the beams run to max_tokens.
    (ignored,) = run_beam_search(
        [[1]],
        BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True),
        _scripted(table, []),
        {EOS},
        None,
    )
    assert ignored.sequences[0].tokens == [1, 5, 6]


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2.0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": True}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
        ({"beam_width": 2, "max_tokens": 4, "ignore_eos": 1}, "ignore_eos"),
        (
            {"beam_width": 2, "max_tokens": 4, "include_stop_str_in_output": "yes"},
            "include_stop_str_in_output",
        ),
    ],
)
def test_params_errors_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


def test_call_errors(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_logprobs=20"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match=r"prompt 1: .*max_model_len=64"):
        llm.beam_search([[1, 2], [1] * 60], BeamSearchParams(beam_width=2, max_tokens=5))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search(PROMPTS, SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompts is empty"):
        llm.beam_search([], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match=r"prompt 0: .*tokenizer"):
        llm.beam_search([TextPrompt(prompt="text")], BeamSearchParams(beam_width=2, max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
