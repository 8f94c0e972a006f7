"""GrammarBackend: specs -> compiled grammars -> per-request matchers (xgrammar).

xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured
Generation Engine for Large Language Models", arXiv:2411.15100) compiles a
grammar against the tokenizer's vocabulary once, then a `GrammarMatcher`
walks it token by token and fills a packed bitmask of the tokens allowed
next: int32 words, bit j of word w set = token 32 * w + j allowed.

JSON is generated compact (`{"a": 1, "b": [2, 3]}`: no free whitespace),
which keeps small models out of endless-whitespace loops; the output is
still plain JSON.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

from tokenmill.structured_output.spec import StructuredOutputSpec, choice_ebnf, import_xgrammar

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256  # compiled grammars kept (LRU by spec key)


def bitmask_width(vocab_size: int) -> int:
    """Int32 words per bitmask row: ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


class GrammarBackend:
    """Compiles specs for one tokenizer; thread-safe (compiles may run off the step thread).

    Args:
        tokenizer: a transformers tokenizer (fast).
        vocab_size: the model's logits width (may exceed the tokenizer's
            vocabulary; the extra ids are never allowed).
        stop_token_ids: ids that end a request (EOS and the generation
            config's extra EOS ids); the grammar allows them only where the
            structure is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = import_xgrammar()
        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(set(stop_token_ids)) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputSpec) -> Any:
        """The `xgrammar.CompiledGrammar` for `spec` (cached by `spec.key`).

        Raises:
            ValueError: the spec does not compile (a front end that called
                `validate_spec` never sends one).
        """
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                return hit
        try:
            compiled = self._compile(spec)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for bad input
            raise ValueError(f"Structured output spec ({spec.kind}) does not compile: {e}") from None
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputSpec) -> Any:
        c = self.compiler
        if spec.kind == "json":
            return c.compile_json_schema(spec.value, any_whitespace=False)
        if spec.kind == "json_object":
            # Any JSON object (the builtin grammar also allows arrays and scalars).
            return c.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "choice":
            return c.compile_grammar(choice_ebnf(spec.choices()))
        if spec.kind == "grammar":
            if "::=" in spec.value:
                return c.compile_grammar(spec.value)
            return c.compile_lark(spec.value)
        raise AssertionError(f"unknown structured output kind {spec.kind!r}")

    def new_matcher(self, compiled: Any) -> Any:
        """A fresh `xgrammar.GrammarMatcher` at the grammar's start."""
        return self._xgr.GrammarMatcher(compiled)

    def new_batch_matcher(self) -> Any:
        """A `BatchGrammarMatcher` (fills many rows of one bitmask on C++ threads)."""
        return self._xgr.BatchGrammarMatcher(max_threads=2)
