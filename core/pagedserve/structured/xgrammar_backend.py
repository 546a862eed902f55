"""The xgrammar backend: constraints compiled against the tokenizer's vocabulary, one matcher per
request, bitmasks filled for a batch in one call.

`check_spec` needs no tokenizer: it turns a constraint into an xgrammar grammar (which parses the
schema, regex or grammar) so bad input is refused with a clear message before it reaches the core.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from pagedserve.structured.backend import GrammarMatcher
from pagedserve.structured.params import StructuredOutputsParams

MAX_WHITESPACE = 20
"""Longest whitespace run JSON output may hold between tokens: room for pretty-printing, while a
model can never stall in whitespace until max_tokens (small models otherwise do)."""

_MAX_FILL_THREADS = max(1, min(8, os.cpu_count() or 1))

# xgrammar prefixes its messages with a timestamp and its C++ source location.
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar admitting exactly one of `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _schema(params: StructuredOutputsParams) -> Any:
    try:
        schema = json.loads(params.spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    # jsonschema knows the meta-schema: it names what is wrong (a bad "type", a non-list "required").
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ValueError(f"invalid JSON schema{' at ' + where if where else ''}: {exc.message}") from None
    return schema


# xgrammar's character class for strings with a length bound admits raw control characters,
# which JSON forbids (parsers reject them); the unbounded string rule already excludes them.
_LOOSE_STRING_CHARS = r"[^\"\\\r\n]"
_STRICT_STRING_CHARS = r"[^\0-\x1f\"\\\r\n]"


def _json_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """JSON matching the schema (`json`) or any JSON object (`json_object`)."""
    schema = params.spec if params.kind == "json" else '{"type": "object"}'
    compact = params.disable_any_whitespace
    grammar = xgr.Grammar.from_json_schema(
        schema,
        any_whitespace=not compact,
        max_whitespace_cnt=None if compact else MAX_WHITESPACE,
        strict_mode=True,
    )
    text = str(grammar)
    if _LOOSE_STRING_CHARS not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHARS, _STRICT_STRING_CHARS))


def to_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The xgrammar grammar of a constraint. Raises ValueError naming what is wrong."""
    kind = params.kind
    try:
        if kind == "json":
            _schema(params)
            return _json_grammar(params)
        if kind == "json_object":
            return _json_grammar(params)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.spec)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(params.choice or ()))
        return xgr.Grammar.from_ebnf(params.spec)
    except ValueError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError with the parser's message
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}.get(kind, kind)
        text = str(exc).strip()
        first_line = _SOURCE_PREFIX.sub("", text.splitlines()[0]) if text else type(exc).__name__
        raise ValueError(f"invalid {what}: {first_line}") from None


def check_spec(params: StructuredOutputsParams) -> None:
    """Raise ValueError if the constraint's schema, regex or grammar is malformed."""
    to_grammar(params)


class XGrammarBackend:
    """Compiles constraints for one tokenizer; thread-safe compilation, matchers per request."""

    name = "xgrammar"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        threaded_fill: bool = True,
    ) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
        # One call fills a whole batch on several threads; off (threaded_fill=False) fills row by
        # row on the engine thread, for debugging or comparison.
        self._batch = xgr.BatchGrammarMatcher(max_threads=_MAX_FILL_THREADS) if threaded_fill else None

    def compile(self, params: StructuredOutputsParams) -> object:
        return self._compiler.compile_grammar(to_grammar(params))

    def new_matcher(self, compiled: object, max_rollback_tokens: int) -> GrammarMatcher:
        assert isinstance(compiled, xgr.CompiledGrammar)
        # Recent xgrammar versions keep unlimited history and deprecate the rollback bound.
        matcher: GrammarMatcher = xgr.GrammarMatcher(compiled)
        return matcher

    def fill_bitmasks(
        self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        if self._batch is not None and len(matchers) > 1:
            xgr_matchers = [m for m in matchers if isinstance(m, xgr.GrammarMatcher)]
            if len(xgr_matchers) != len(matchers):
                raise TypeError("XGrammarBackend fills only the matchers it made (new_matcher)")
            self._batch.batch_fill_next_token_bitmask(xgr_matchers, bitmask, list(rows))
            return
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.fill_next_token_bitmask(bitmask, row)
