"""The xgrammar backend: constraints compiled against the tokenizer's vocabulary, one matcher per
request, bitmasks filled for a batch in one call.

`check_spec` needs no tokenizer: it turns a constraint into an xgrammar grammar (which parses the
schema, regex, grammar or structural tag) so bad input is refused with a clear message before it
reaches the core.
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

# xgrammar prefixes its messages with a timestamp and its C++ source location, or with the name
# of its exception class.
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*|^Invalid (structural tag|JSON) error:\s*")


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar admitting exactly one of `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _schema(params: StructuredOutputsParams) -> Any:
    try:
        schema = json.loads(params.spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
    return _checked_schema(schema)


def _checked_schema(schema: Any, where: str = "") -> Any:
    """`schema` if it is a valid JSON schema; else ValueError naming `where` (a path in the
    request) and what is wrong."""
    prefix = f"{where}: " if where else ""
    if not isinstance(schema, dict | bool):
        raise ValueError(f"{prefix}a JSON schema must be an object, got {type(schema).__name__}")
    # jsonschema knows the meta-schema: it names what is wrong (a bad "type", a non-list "required").
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        at = "/".join(str(p) for p in exc.path)
        raise ValueError(f"{prefix}invalid JSON schema{' at ' + at if at else ''}: {exc.message}") from None
    return schema


def _structural_tag_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """vLLM's two forms of a structural tag, both compiled by xgrammar: the legacy
    {"structures": [{"begin", "schema", "end"}], "triggers": [...]} and xgrammar's own
    {"type": "structural_tag", "format": {...}}."""
    try:
        tag = json.loads(params.spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid structural tag: not valid JSON: {exc}") from None
    if not isinstance(tag, dict):
        raise ValueError(f"invalid structural tag: a JSON object is needed, got {type(tag).__name__}")
    if "structures" not in tag and "triggers" not in tag:
        return xgr.Grammar.from_structural_tag(json.dumps(tag))
    if "format" in tag:
        raise ValueError("invalid structural tag: give either format or structures and triggers, not both")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError("invalid structural tag: structures must be a non-empty list of objects")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("invalid structural tag: triggers must be a non-empty list of non-empty strings")
    items: list[xgr.StructuralTagItem] = []
    for i, item in enumerate(structures):
        where = f"invalid structural tag: structures[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object with begin, schema and end")
        for field in ("begin", "end"):
            if not isinstance(item.get(field), str):
                raise ValueError(f"{where}.{field} must be a string")
        if "schema" not in item:
            raise ValueError(f"{where}.schema is missing (a JSON schema)")
        schema = _checked_schema(item["schema"], f"{where}.schema")
        items.append(xgr.StructuralTagItem(begin=item["begin"], schema=json.dumps(schema), end=item["end"]))
    structural = xgr.StructuralTag.from_legacy_structural_tag(items, triggers)
    # Tagged JSON gets the same whitespace bound as a `json` constraint, so a model cannot stall
    # inside a tag either.
    for tagged in structural.format.tags:  # type: ignore[union-attr]  # legacy: triggered_tags
        content = tagged.content
        if isinstance(content, xgr.structural_tag.JSONSchemaFormat):
            content.max_whitespace_cnt = MAX_WHITESPACE
    return xgr.Grammar.from_structural_tag(structural)


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
        if kind == "structural_tag":
            return _structural_tag_grammar(params)
        return xgr.Grammar.from_ebnf(params.spec)
    except ValueError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError with the parser's message
        what = {
            "json": "JSON schema",
            "regex": "regex",
            "grammar": "grammar",
            "structural_tag": "structural tag",
        }.get(kind, kind)
        text = str(exc).strip()
        first_line = _SOURCE_PREFIX.sub("", text.splitlines()[0]) if text else type(exc).__name__
        raise ValueError(f"invalid {what}: {first_line}") from None


def check_spec(params: StructuredOutputsParams) -> None:
    """Raise ValueError if the constraint's schema, regex, grammar or structural tag is malformed."""
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
