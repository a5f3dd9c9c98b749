"""Structured outputs as one llguidance grammar (`SamplingParams.grammar`): what the front ends turn
OpenAI's `response_format`, vLLM's `structured_outputs` (json, regex, choice, grammar, json_object)
and a forced tool call into, checked here so that a bad schema, regex or grammar is a 400 naming its
field before any replica sees it — checked against the model's tokenizer where the caller has one
(`GrammarTokenizer`: a special token or token id the vocabulary lacks is the request's fault too).
The engine compiles the grammar against its tokenizer and masks the logits
(pdserve/engine/grammar.py). No torch: the routers import this."""

import json
import threading
from typing import Any

import llguidance

from pdserve.protocol import InvalidRequestError

# JSON is generated compact (", " and ": " between items, no other whitespace): a model cannot spend
# its tokens on whitespace, and a random-weight model's JSON ends.
_JSON_OPTIONS = {"whitespace_flexible": False}
_ANY_JSON_OBJECT = {"type": "object"}
KINDS = ("json", "regex", "choice", "grammar", "json_object")


def ll_tokenizer(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """A tokenizer as llguidance's: an HF tokenizer's tokenizer.json; a preset's byte tokenizer as
    the HF tokenizer files it equals (pdserve.tokenizer.byte_tokenizer_as_hf). `vocab_size`: the
    model's (its logits' width), which may exceed the tokenizer's."""
    from pdserve.tokenizer import ByteTokenizer, byte_tokenizer_as_hf

    if isinstance(tokenizer, ByteTokenizer):
        spec = json.dumps(byte_tokenizer_as_hf(max(vocab_size, tokenizer.vocab_size), 1 << 20)["tokenizer.json"])
    else:
        spec = tokenizer.backend.to_str()
    # llguidance takes only end tokens its vocabulary spells; a model's config may name one past the
    # tokenizer's ids (the request still ends where its grammar does: engine/grammar.py).
    eos = [i for i in tokenizer.eos_token_ids if i < tokenizer.vocab_size]
    return llguidance.LLTokenizer(spec, n_vocab=vocab_size, eos_token=eos or None)


class GrammarTokenizer:
    """A model's tokenizer as llguidance's, built once on first use, on any thread (a large vocabulary
    takes ~1 s): what a router checks grammars against and an engine compiles them with. A tokenizer
    llguidance refuses is refused once: every later call raises the same error at once (built again
    per grammar, a 256-request burst queued ~256 such builds behind the lock)."""

    def __init__(self, tokenizer, vocab_size: int | None = None):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the logits' width, where it exceeds the tokenizer's (else the tokenizer's)
        self._ll: llguidance.LLTokenizer | None = None
        self._error: Exception | None = None
        self._lock = threading.Lock()

    def get(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None and self._error is None:
                try:
                    self._ll = ll_tokenizer(self._tokenizer, self._vocab_size or self._tokenizer.vocab_size)
                except Exception as e:
                    self._error = ValueError(
                        f"the model's tokenizer is not usable for grammars ({e}): structured outputs and forced "
                        "tool calls cannot run on this model; check its tokenizer.json (llguidance reads it)")
            if self._error is not None:
                raise self._error
        return self._ll


def json_schema_grammar(param: str, schema: Any, tokenizer: GrammarTokenizer | None = None) -> str:
    """The grammar of JSON text matching `schema` (a dict, or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(param, f"is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(param, f"must be a JSON schema (an object), got {type(schema).__name__}")
    return _checked(param, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS), tokenizer)


def grammar_of(param: str, kind: str, spec: Any, tokenizer: GrammarTokenizer | None = None) -> str:
    """The grammar of one structured-output request: `kind` one of KINDS, `spec` its value; an error
    names `param`. `tokenizer`: the model's, which the grammar is checked against too."""
    if kind == "json":
        return json_schema_grammar(param, spec, tokenizer)
    if kind == "json_object":
        return json_schema_grammar(param, _ANY_JSON_OBJECT, tokenizer)
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise InvalidRequestError(param, "must be a non-empty regular expression")
        return _checked(param, llguidance.LLMatcher.grammar_from_regex(spec), tokenizer)
    if kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise InvalidRequestError(param, "must be a non-empty list of non-empty strings")
        # Lark string literals take JSON's escapes: each choice is matched exactly.
        return _checked(param, llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in spec)), tokenizer)
    if kind == "grammar":
        if not isinstance(spec, str) or not spec.strip():
            raise InvalidRequestError(param, "must be a non-empty grammar (Lark, or GBNF with ::= rules)")
        lark = llguidance.gbnf_to_lark.gbnf_to_lark(spec) if "::=" in spec else spec
        return _checked(param, llguidance.LLMatcher.grammar_from_lark(lark), tokenizer)
    raise InvalidRequestError(param, f"unknown kind {kind!r}; one of {', '.join(KINDS)}")


def _checked(param: str, grammar: str, tokenizer: GrammarTokenizer | None) -> str:
    # (Against the tokenizer the check costs what it costs without: the grammar's compile.)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer.get() if tokenizer is not None else None)
    if error:
        raise InvalidRequestError(param, f"is not a valid grammar: {error.strip()}")
    return grammar
