"""The OpenAI API's request side as pdserve accepts it: the endpoints, the request bodies with their
validators, and the error body every failure answers with.

Validation here is what the body alone decides (types, ranges, fields pdserve does not support); what
needs the model (token counts against the context, the chat template) is checked while serving."""

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SkipValidation, ValidationInfo, field_validator

from pdserve.protocol import MAX_CACHE_SALT_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS, InvalidRequestError, SamplingParams
from pdserve.structured_outputs import KINDS, GrammarTokenizer, grammar_of, json_schema_grammar

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GENERATION_ENDPOINTS = (COMPLETIONS, CHAT)

# Python's JSON parser accepts NaN and Infinity; the sampler must never see them.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


def _only(value: Any, allowed: tuple, what: str) -> Any:
    if value not in allowed:
        raise ValueError(f"is not supported; only {what} is accepted")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk carries the usage so far too.
    continuous_usage_stats: bool | None = False


class SamplingRequest(BaseModel):
    """Fields both generation endpoints take. Unknown fields (e.g. `metadata`) are ignored, as OpenAI does;
    known-but-unsupported ones are accepted only at their no-op value, since silently ignoring, say, a
    penalty would return output the caller did not ask for."""

    model_config = ConfigDict(extra="ignore")

    model: Annotated[str, Field(min_length=1)]
    max_tokens: int | None = None
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None  # vLLM extension; 0 or -1 = off
    seed: Annotated[int, Field(ge=-2**63, le=2**64 - 1)] | None = None  # the range torch generators take
    stop: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Choices per prompt: the router runs n sequences (http_choices.py); at most router.max_n.
    n: Annotated[int, Field(ge=1)] | None = 1
    ignore_eos: bool | None = False  # vLLM extension
    # Ranges (vLLM's) are checked by SamplingParams: its error names the field.
    frequency_penalty: FiniteFloat | None = 0.0
    presence_penalty: FiniteFloat | None = 0.0
    repetition_penalty: FiniteFloat | None = 1.0  # vLLM extension
    logit_bias: dict[str, FiniteFloat] | None = None  # token id (as a string, JSON's keys) -> bias in [-100, 100]
    min_tokens: Annotated[int, Field(ge=0)] | None = 0  # vLLM extension
    min_p: FiniteFloat | None = 0.0  # vLLM extension
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # vLLM extension
    # OpenAI's end-user id. The router's session key: a conversation's turns go where its prefix is
    # cached (router/policy.py, prefix-aware placement).
    user: Annotated[str, Field(max_length=512)] | None = None
    # vLLM extension: the lower, the sooner the request is admitted and scheduled, and the later it
    # is preempted; unset means 0. The range is gRPC's int32, so that both front ends take the same.
    priority: Annotated[int, Field(ge=-2**31, le=2**31 - 1)] | None = None
    # vLLM extension: only requests with the same salt share prefix-cache blocks. With API keys it is
    # added to the key's own salt (router/tenants.py Tenant.cache_salt): it splits, never joins.
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    # Structured outputs (pdserve/structured_outputs.py): OpenAI's response_format (text, json_object,
    # json_schema) or vLLM's structured_outputs (one of json, regex, choice, grammar, json_object).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's earlier names for structured_outputs' kinds, still sent by older clients.
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # pdserve extension: false opts this request out of its replica's speculative decoding.
    speculative: bool | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop_lengths(cls, v: Any) -> Any:
        if v and any(len(s) > MAX_STOP_CHARS for s in v):
            raise ValueError(f"each stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not info.data.get("stream"):
            raise ValueError("is only allowed when stream is true")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: Any) -> Any:
        if v and not all(k.isdigit() for k in v):
            raise ValueError("keys must be token ids (non-negative integers, as strings)")
        return v

    @field_validator("structured_outputs")
    @classmethod
    def _one_kind(cls, v: Any) -> Any:
        asked = [k for k in KINDS if v and v.get(k) not in (None, False)]
        if v is not None and len(asked) != 1:
            raise ValueError(f"must set exactly one of {', '.join(KINDS)}")
        return v

    def asks_structure(self) -> bool:
        """A structured-output field is set: structured_grammar has a grammar to build and check."""
        return (self.structured_outputs is not None or self.response_format not in (None, {"type": "text"})
                or any(getattr(self, f"guided_{k}") is not None for k in ("json", "regex", "choice", "grammar")))

    def structured_grammar(self, tokenizer: GrammarTokenizer | None = None) -> str | None:
        """The grammar the output must match (None: free text), checked (against `tokenizer` too, the
        model's); InvalidRequestError names the field at fault."""
        guided = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, f"guided_{k}") is not None]
        if guided:
            if len(guided) > 1 or self.structured_outputs is not None:
                raise InvalidRequestError(f"guided_{guided[-1]}", "only one of structured_outputs and the "
                                                                  "guided_* fields may be set")
            return grammar_of(f"guided_{guided[0]}", guided[0], getattr(self, f"guided_{guided[0]}"), tokenizer)
        if self.structured_outputs is not None and self.response_format not in (None, {"type": "text"}):
            raise InvalidRequestError("structured_outputs", "may not be set together with a response_format")
        if self.structured_outputs is not None:
            kind = next(k for k in KINDS if self.structured_outputs.get(k) not in (None, False))
            return grammar_of(f"structured_outputs.{kind}", kind, self.structured_outputs[kind], tokenizer)
        rf = self.response_format
        kind = rf.get("type") if rf is not None else "text"
        if kind == "text":
            return None
        if kind == "json_object":
            return grammar_of("response_format", "json_object", None, tokenizer)
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise InvalidRequestError("response_format.json_schema",
                                          'must be {"name": ..., "schema": {...}}')
            return json_schema_grammar("response_format.json_schema.schema", spec["schema"], tokenizer)
        raise InvalidRequestError("response_format.type", f'must be "text", "json_object" or "json_schema", got {kind!r}')

    def sampling_params(self, max_tokens: int, logprobs: int | None, cache_salt: str | None = None,
                        grammar: str | None = None) -> SamplingParams:
        """The engine's parameters; SamplingParams checks the ranges (InvalidRequestError names the field).
        cache_salt: the prefix-cache salt the router gives the request (its key's and its own); grammar:
        the request's structured_grammar() (chat: or its forced tool call's), built once per request."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),  # vLLM clients send -1 for "off"
            seed=self.seed,
            stop=list(self.stop or []),
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            stop_token_ids=list(self.stop_token_ids or []),
            min_tokens=self.min_tokens or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=dict(self.logit_bias or {}),
            cache_salt=cache_salt,
            grammar=grammar,
            speculative=self.speculative is not False,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (stream_options.continuous_usage_stats, only with include_usage: vLLM's)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


def _one(v: Any) -> bool:
    """Whether v is one prompt: a non-empty string, or non-empty token ids. Every id an int (not a
    bool) and none negative, checked by C loops: a long prompt's ids are thousands, and a Python loop
    over them cost its admission more than the rest of the body."""
    if isinstance(v, str):
        return bool(v)
    return isinstance(v, list) and bool(v) and set(map(type, v)) == {int} and min(v) >= 0


class CompletionRequest(SamplingRequest):
    # A string, or token ids; or a batch of either (`_one_prompt`): one choice per prompt and n. `_one_prompt` checks
    # every id's type itself, so pydantic's own check of the type is skipped: for a prompt of token ids
    # it went over them all again, element by element, and cost the admission more than the rest of
    # the body (the schema stays the type's).
    prompt: Annotated[SkipValidation[str | list[int] | list[str] | list[list[int]]], Field(json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1}, _IDS_SCHEMA,  # what `_one_prompt` checks
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": _IDS_SCHEMA, "minItems": 1}]})]
    logprobs: int | None = None  # completions style: how many alternatives per token (0..20)
    echo: bool | None = False  # the prompt's text before each choice's
    # Sequences generated per prompt, of which the n with the highest cumulative logprob are returned
    # (vLLM's, OpenAI's); >= n, not with stream.
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]  # a batch of one
        if _one(v):
            return v
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) and _one(p) for p in v):
            return v  # a batch
        raise ValueError("must be a non-empty string, a non-empty list of token ids, or a list of either")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch's."""
        p = self.prompt
        return p if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]

    @field_validator("best_of")
    @classmethod
    def _at_least_n(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and v < (info.data.get("n") or 1):
            raise ValueError(f"must be at least n ({info.data.get('n')}), got {v}")
        if v is not None and v > (info.data.get("n") or 1) and info.data.get("stream"):
            raise ValueError("may not exceed n when stream is true (the best are known only at the end)")
        return v

    @field_validator("echo")
    @classmethod
    def _no_prompt_logprobs(cls, v: Any, info: ValidationInfo) -> Any:
        # Echoed with logprobs, the prompt's tokens would need theirs: the engine computes none.
        if v and info.data.get("logprobs") is not None:
            raise ValueError("is not supported together with logprobs (pdserve computes no prompt logprobs)")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: Any) -> Any:
        return _only(v, (None, ""), "no suffix")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None  # null only for an assistant's turn (OpenAI sends it with tool calls)
    # A conversation's earlier calls and their results, for the chat template: an assistant's
    # tool_calls (as this API returned them), a tool message's tool_call_id (and name).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in v):
            raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts; '
                             "only text is supported")
        return "\n".join(p["text"] for p in v)

    @field_validator("content")
    @classmethod
    def _text_unless_assistant(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and info.data.get("role") != "assistant":
            raise ValueError("must be a string (only an assistant message may have null content)")
        return v

    def for_template(self) -> dict:
        """The message as chat templates read it: content always a string; a call's arguments as an
        object (HF templates write `arguments | tojson` unless they are a string already)."""
        message = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            message["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            pass  # left as the text it is
    return {**call, "function": fn}


class FunctionDefinition(BaseModel):
    # Fields a template may read besides these (e.g. `strict`) reach it as sent.
    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments


class ChatTool(BaseModel):
    """One OpenAI tool definition: `{"type": "function", "function": {"name": ..., ...}}`."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict:
        """The definition as the client sent it, as HF's `apply_chat_template(tools=...)` takes it."""
        return self.model_dump(exclude_unset=True)


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Rendered into the prompt by the chat template (its `tools` variable), so that the model can answer with
    # a call in its own format, parsed back into `tool_calls` (router/tool_calls.py).
    tools: list[ChatTool] | None = None
    # "none", "auto" (the default with tools), "required" or {"type": "function", "function": {"name": ...}}:
    # the last two are forced with a grammar (router/tool_calls.py).
    tool_choice: Any = None
    # vLLM's extension: extra variables for the chat template, e.g. Qwen3's {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("requires logprobs: true")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_shape(cls, v: Any) -> Any:
        named = isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) \
            and isinstance(v["function"].get("name"), str)
        if v not in (None, "none", "auto", "required") and not named:
            raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _tools_have_their_own_field(cls, v: Any) -> Any:
        # The template's `tools` variable is the request's `tools` field; the other variables the renderer
        # sets itself (messages, add_generation_prompt, ...) are refused by the tokenizer, which owns them.
        if v and "tools" in v:
            raise ValueError("may not set 'tools'; send the tool definitions in the request's tools field")
        return v

    def template_tools(self) -> list[dict] | None:
        return [t.for_template() for t in self.tools] if self.tools else None


# -- vLLM's tokenizer endpoints ----------------------------------------------------------------------

TOKENIZE, DETOKENIZE, VERSION = "/tokenize", "/detokenize", "/version"


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt, as /v1/completions counts it; or messages, rendered by the model's
    template as /v1/chat/completions renders them (add_generation_prompt: the assistant's turn
    opened), then tokenized."""

    model_config = ConfigDict(extra="ignore")
    model: Annotated[str, Field(min_length=1)] | None = None  # (vLLM's may leave it out)
    prompt: str | None = None
    # (Validated when left out too: `_prompt_or_messages` says which of the two is missing.)
    messages: Annotated[Annotated[list[ChatMessage], Field(min_length=1)] | None, Field(validate_default=True)] = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template writes its BOS)
    return_token_strs: bool = False
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _prompt_or_messages(cls, v: Any, info: ValidationInfo) -> Any:
        if (v is None) == (info.data.get("prompt") is None):
            raise ValueError("send either prompt (a string) or messages (a chat), not both and not neither")
        return v

    def template_tools(self) -> list[dict] | None:
        return [t.for_template() for t in self.tools] if self.tools else None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Annotated[str, Field(min_length=1)] | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error's body, in OpenAI's shape."""

    error: ErrorDetail
