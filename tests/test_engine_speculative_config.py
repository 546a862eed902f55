"""`speculative_config` (vLLM's dict) and `num_speculative_tokens`: resolved once into a frozen
`SpeculativeConfig`, with unknown methods, unknown keys and mismatched vocabularies refused by name."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pagedserve.cli.engine_options import add_engine_options, engine_args_from
from pagedserve.config import EngineArgs
from pagedserve.config.speculative import resolve_speculative_config


def _resolve(raw: dict | None, k: int = 0, *, draft_vocab: int | None = None, tp: int = 1):
    return resolve_speculative_config(
        raw, k, target_vocab_size=128, draft_vocab_size=draft_vocab, tensor_parallel_size=tp
    )


def test_num_speculative_tokens_alone_means_ngram() -> None:
    config = _resolve(None, 3)
    assert config is not None and config.method == "ngram" and config.num_speculative_tokens == 3
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (1, 3)
    assert _resolve(None, 0) is None


def test_each_method_resolves() -> None:
    ngram = _resolve({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5})
    assert ngram is not None and ngram.prompt_lookup_max == 5 and not ngram.uses_draft_model
    for method in ("draft_model", "eagle", "eagle3"):
        config = _resolve({"method": method, "model": "/d", "num_speculative_tokens": 2}, draft_vocab=128)
        assert config is not None and config.method == method and config.model == "/d"
        assert config.uses_draft_model
    inferred = _resolve({"model": "/d", "num_speculative_tokens": 2})
    assert inferred is not None and inferred.method == "draft_model"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"method": "medusa", "model": "/d", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "'lookahead'"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "model": "/d", "num_speculative_tokens": 2}, "model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
        (
            {"model": "/d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
            "draft_tensor_parallel_size",
        ),
        ({"method": "ngram", "num_speculative_tokens": 40}, "num_speculative_tokens"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(raw: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        EngineArgs(speculative_config=raw)


def test_mismatched_vocabulary_and_tensor_parallel_drafts_are_refused() -> None:
    raw = {"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"speculative_config.model .* 100 tokens .* 128"):
        _resolve(raw, draft_vocab=100)
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        _resolve(raw, draft_vocab=128, tp=2)
    with pytest.raises(ValueError, match="disagree"):
        _resolve({"method": "ngram", "num_speculative_tokens": 2}, 3)


def test_cli_flag_takes_json() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert engine_args_from(args, None).speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "[1, 2]"])
