"""Structured outputs as one llguidance grammar (`SamplingParams.grammar`): what the front ends turn
OpenAI's `response_format`, vLLM's `structured_outputs` (json, regex, choice, grammar, json_object)
and a forced tool call into, checked here so that a bad schema, regex or grammar is a 400 naming its
field before any replica sees it. The engine compiles the grammar against its tokenizer and masks
the logits (pdserve/engine/grammar.py). No torch: the routers import this."""

import json
from typing import Any

import llguidance

from pdserve.protocol import InvalidRequestError

# JSON is generated compact (", " and ": " between items, no other whitespace): a model cannot spend
# its tokens on whitespace, and a random-weight model's JSON ends.
_JSON_OPTIONS = {"whitespace_flexible": False}
_ANY_JSON_OBJECT = {"type": "object"}
KINDS = ("json", "regex", "choice", "grammar", "json_object")


def json_schema_grammar(param: str, schema: Any) -> str:
    """The grammar of JSON text matching `schema` (a dict, or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(param, f"is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(param, f"must be a JSON schema (an object), got {type(schema).__name__}")
    return _checked(param, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS))


def grammar_of(param: str, kind: str, spec: Any) -> str:
    """The grammar of one structured-output request: `kind` one of KINDS, `spec` its value; an error names `param`."""
    if kind == "json":
        return json_schema_grammar(param, spec)
    if kind == "json_object":
        return json_schema_grammar(param, _ANY_JSON_OBJECT)
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise InvalidRequestError(param, "must be a non-empty regular expression")
        return _checked(param, llguidance.LLMatcher.grammar_from_regex(spec))
    if kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise InvalidRequestError(param, "must be a non-empty list of non-empty strings")
        # Lark string literals take JSON's escapes: each choice is matched exactly.
        return _checked(param, llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in spec)))
    if kind == "grammar":
        if not isinstance(spec, str) or not spec.strip():
            raise InvalidRequestError(param, "must be a non-empty grammar (Lark, or GBNF with ::= rules)")
        lark = llguidance.gbnf_to_lark.gbnf_to_lark(spec) if "::=" in spec else spec
        return _checked(param, llguidance.LLMatcher.grammar_from_lark(lark))
    raise InvalidRequestError(param, f"unknown kind {kind!r}; one of {', '.join(KINDS)}")


def _checked(param: str, grammar: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(param, f"is not a valid grammar: {error.strip()}")
    return grammar
