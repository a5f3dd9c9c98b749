"""Text <-> token ids and chat templates: HF `tokenizer.json` models and a byte-level tokenizer for presets."""

import codecs
import json
import os
import re
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    """A HF model's tokenizer: `tokenizer.json` plus the special tokens and chat template of its configs."""

    def __init__(self, model_dir: str, eos_token_ids: list[int] | None = None):
        self._tok = HFTokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        self._add_added_tokens(config.get("added_tokens_decoder", {}))

        self.bos_token: str | None = _token_content(config.get("bos_token"))
        self.eos_token: str | None = _token_content(config.get("eos_token"))
        self.bos_token_id: int | None = self._token_id(self.bos_token)
        eos_ids = set(eos_token_ids or [])
        if (eos_id := self._token_id(self.eos_token)) is not None:
            eos_ids.add(eos_id)
        gen_eos = _read_json(os.path.join(model_dir, "generation_config.json")).get("eos_token_id")
        eos_ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos or [])
        self.eos_token_ids: list[int] = sorted(eos_ids)

        # Explicit flags rebuild the post-processor, as transformers' Llama-style tokenizers do (the generic
        # PreTrainedTokenizerFast.from_pretrained of transformers 5 ignores them next to tokenizer.json).
        if "add_bos_token" in config or "add_eos_token" in config:
            self._set_post_processor(bool(config.get("add_bos_token")), bool(config.get("add_eos_token")))
        self.chat_template: str | None = _find_chat_template(model_dir, config.get("chat_template"))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers.Tokenizer` behind this one (what `tokenizers.decoders.DecodeStream` steps with)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], /, tools: list[dict] | None = None, *,
                            generation_prompt: bool = True, **template_kwargs) -> str:
        """The prompt text for a chat (ending in the assistant's turn, unless not generation_prompt: the
        template's add_generation_prompt, named apart so that a request's own variable of that name
        reaches the renderer, which refuses it),
        rendered with the model's Jinja template as transformers' `apply_chat_template` does: `tools` and
        every extra keyword (e.g. Qwen3's `enable_thinking=False`) become template variables; a keyword
        pdserve sets itself raises ValueError."""
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template (none in tokenizer_config.json or chat_template.jinja); "
                "use /v1/completions with a plain prompt instead"
            )
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        return render_chat_template(self.chat_template, messages, generation_prompt, special, tools, template_kwargs)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _add_added_tokens(self, added_tokens_decoder: dict) -> None:
        # tokenizer.json normally holds these already; older checkpoints list some only in the config.
        for entry in added_tokens_decoder.values():
            if self._tok.token_to_id(entry["content"]) is not None:
                continue
            token = AddedToken(
                entry["content"],
                single_word=entry.get("single_word", False),
                lstrip=entry.get("lstrip", False),
                rstrip=entry.get("rstrip", False),
                normalized=entry.get("normalized", not entry.get("special", False)),
                special=entry.get("special", False),
            )
            if token.special:
                self._tok.add_special_tokens([token])
            else:
                self._tok.add_tokens([token])

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        add_bos = add_bos and self.bos_token_id is not None
        eos_id = self._token_id(self.eos_token)
        add_eos = add_eos and eos_id is not None
        bos, eos = self.bos_token, self.eos_token
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        special = ([(bos, self.bos_token_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
        self._tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


# ChatML, as Qwen models use it, so preset models can serve /v1/chat/completions.
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus four ChatML special tokens, for presets that ship no tokenizer files.

    Decoding always gives printable text: a random-weight preset emits arbitrary bytes, which as
    UTF-8 would be mostly U+FFFD and control characters. Valid UTF-8 that reads as text (printable
    characters, tab, newline and other whitespace) decodes as itself, so encoding such text and
    decoding it gives it back; every other byte (invalid or incomplete UTF-8, control and other
    unprintable characters) becomes its stand-in of GPT-2's byte-level alphabet (`BYTE_CHARS`)."""

    SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")  # ids 256..259
    _SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")

    def __init__(self):
        self.bos_token: str = "<|bos|>"
        self.eos_token: str = "<|eos|>"
        self.bos_token_id: int = 256
        self.eos_token_ids: list[int] = [257, 259]
        self.chat_template: str = BYTE_CHAT_TEMPLATE

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIAL_TOKENS)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """UTF-8 bytes of `text`, special-token strings as their ids, `<|bos|>` first if `add_special_tokens`."""
        ids = [self.bos_token_id] if add_special_tokens else []
        for i, part in enumerate(self._SPECIAL_RE.split(text)):
            if i % 2:  # re.split puts the captured separators at odd positions
                ids.append(256 + self.SPECIAL_TOKENS.index(part))
            else:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Printable text of `ids` (see the class), special ids their names unless skipped.

        A preset model's vocabulary is larger than ours: an id past the special tokens is ordinary
        output this tokenizer cannot spell, written `<|token_N|>` whether specials are skipped or
        not, so that a dummy model's output streams token by token instead of as nothing."""
        stream = ByteDecodeStream(self, skip_special_tokens)
        return "".join([stream.step(i) or "" for i in ids]) + stream.flush()

    def apply_chat_template(self, messages: list[dict], /, tools: list[dict] | None = None, *,
                            generation_prompt: bool = True, **template_kwargs) -> str:
        """The prompt text for a chat, in ChatML (ending in the assistant's turn, unless not
        generation_prompt); the same arguments as `Tokenizer.apply_chat_template` (this template
        ignores tools and extra variables)."""
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        return render_chat_template(self.chat_template, messages, generation_prompt, special, tools, template_kwargs)

    def is_skipped(self, token_id: int, skip_special_tokens: bool) -> bool:
        """Whether `decode` leaves `token_id` out (one of our special tokens, when they are skipped)."""
        return skip_special_tokens and 256 <= token_id < 256 + len(self.SPECIAL_TOKENS)

    def special_name(self, token_id: int) -> str:
        # A preset model's vocabulary may be larger than ours; its extra ids still need a printable name.
        k = token_id - 256
        return self.SPECIAL_TOKENS[k] if k < len(self.SPECIAL_TOKENS) else f"<|token_{token_id}|>"


class ByteDecodeStream:
    """`ByteTokenizer`'s incremental decoder, as `tokenizers.decoders.DecodeStream` is an HF tokenizer's:
    `step(token_id)` returns the text that id completes, or None while it only began a character;
    `flush()` returns what is still held back once the ids end. Steps and flush join to `decode`."""

    def __init__(self, tokenizer: ByteTokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._held = bytearray()  # the start of a character whose remaining bytes may still come

    def step(self, token_id: int) -> str | None:
        if token_id < 256:
            self._held.append(token_id)
            text, used = printable_utf8(self._held, final=False)
            del self._held[:used]
            return text or None
        if self._tok.is_skipped(token_id, self._skip):
            return None  # left out: the bytes around it still join into characters
        return self.flush() + self._tok.special_name(token_id)

    def flush(self) -> str:
        text, _ = printable_utf8(self._held, final=True)
        self._held.clear()
        return text


def _bytes_to_unicode() -> list[str]:
    # GPT-2's table: printable Latin-1 bytes stand for themselves, the others for code points from 256 on.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


BYTE_CHARS: list[str] = _bytes_to_unicode()  # every byte's printable stand-in
# Bytes a UTF-8 character of that length starts with (0: none, a continuation or an invalid byte).
_UTF8_LENGTH = [1] * 0x80 + [0] * 0x42 + [2] * 0x1E + [3] * 0x10 + [4] * 0x05 + [0] * 0x0B


def _readable(ch: str) -> bool:
    # Printable, or whitespace that is not a control character (tab, newline and carriage return are kept).
    return ch.isprintable() or ch in "\t\n\r" or (ch.isspace() and ch >= "\xa0")


def _utf8_prefix(data: bytes) -> bool:
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
        return True
    except UnicodeDecodeError:
        return False


def printable_utf8(data: bytes | bytearray, final: bool = True) -> tuple[str, int]:
    """The printable text of `data` and how many of its bytes that text covers: readable UTF-8
    characters as themselves, any other byte as its `BYTE_CHARS` stand-in. Unless `final`, an
    incomplete character at the end is left out (not covered) while its remaining bytes may still come."""
    out: list[str] = []
    i = 0
    while i < len(data):
        length = _UTF8_LENGTH[data[i]]
        chunk = bytes(data[i : i + length])
        if len(chunk) < length and not final and _utf8_prefix(chunk):
            break
        try:
            ch = chunk.decode("utf-8") if length and len(chunk) == length else None
        except UnicodeDecodeError:
            ch = None
        if ch is None:  # invalid here: this byte alone
            out.append(BYTE_CHARS[data[i]])
            i += 1
        else:
            out.append(ch if _readable(ch) else "".join(BYTE_CHARS[b] for b in chunk))
            i += length
    return "".join(out), i


def byte_tokenizer_as_hf(vocab_size: int, max_length: int) -> dict[str, dict]:
    """`ByteTokenizer` as HF tokenizer files (file name -> JSON): tokenizer.json (byte-level BPE
    without merges: byte b is id b; the four special tokens 256..259; ids from 260 to vocab_size
    spelled `<|token_N|>`, as ByteTokenizer spells them, never produced by encoding; `<|bos|>` put
    first), tokenizer_config.json (the same special tokens and ChatML template) and the
    generation_config.json ids. Encoding is ByteTokenizer's exactly; decoding differs only for bytes
    that are not printable UTF-8, which HF decodes as U+FFFD where ByteTokenizer shows a stand-in."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    byte_tok = ByteTokenizer()
    vocab = {ch: b for b, ch in enumerate(BYTE_CHARS)}
    vocab |= {t: 256 + i for i, t in enumerate(ByteTokenizer.SPECIAL_TOKENS)}
    vocab |= {byte_tok.special_name(i): i for i in range(byte_tok.vocab_size, vocab_size)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split, no prefix space: every byte of the text becomes its own token, as in ByteTokenizer.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ByteTokenizer.SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{byte_tok.bos_token} $A", pair=f"{byte_tok.bos_token} $A $B:1",
        special_tokens=[(byte_tok.bos_token, byte_tok.bos_token_id)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": byte_tok.bos_token,
              "eos_token": byte_tok.eos_token, "add_bos_token": True, "add_eos_token": False,
              "model_max_length": max_length, "clean_up_tokenization_spaces": False,
              "chat_template": byte_tok.chat_template}
    generation = {"bos_token_id": byte_tok.bos_token_id, "eos_token_id": byte_tok.eos_token_ids}
    return {"tokenizer.json": json.loads(tok.to_str()), "tokenizer_config.json": config,
            "generation_config.json": generation}


def load_tokenizer(path_or_preset: str, eos_token_ids: list[int] | None = None) -> Tokenizer | ByteTokenizer:
    """The tokenizer of a model directory, or the byte tokenizer for a preset name."""
    if not os.path.isdir(path_or_preset):
        return ByteTokenizer()
    if not os.path.isfile(os.path.join(path_or_preset, "tokenizer.json")):
        raise FileNotFoundError(
            f"model directory {path_or_preset!r} has no tokenizer.json; pdserve loads tokenizers only from "
            "tokenizer.json (convert slow/sentencepiece tokenizers with transformers' save_pretrained)"
        )
    return Tokenizer(path_or_preset, eos_token_ids)


# Template variables and globals pdserve sets itself: a chat_template_kwargs key may not replace them.
_RESERVED_TEMPLATE_VARS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
     "raise_exception", "strftime_now"}
)


def render_chat_template(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool,
    special_tokens: dict[str, str | None],
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> str:
    """Render a chat template the way transformers' `apply_chat_template` does: `tools` (None when absent)
    and `template_kwargs` become template variables."""
    template_kwargs = template_kwargs or {}
    for key in template_kwargs:
        if key in _RESERVED_TEMPLATE_VARS or key in special_tokens:
            raise ValueError(
                f"chat_template_kwargs: {key!r} is set by pdserve; the keys it sets itself are "
                f"{sorted(_RESERVED_TEMPLATE_VARS | special_tokens.keys())}"
            )
    try:
        return _compile_template(template).render(
            **template_kwargs,
            messages=[_plain_message(m) for m in messages],
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in special_tokens.items() if v is not None},
        )
    except jinja2.TemplateError as e:  # raise_exception() in templates reports bad chats, e.g. wrong role order
        raise ValueError(f"chat template rejected the messages: {e}") from e


def _plain_message(message: dict) -> dict:
    # Like transformers: drop None fields (OpenAI clients send content=None), which templates handle as absent.
    message = {k: v for k, v in message.items() if v is not None}
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text":
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            texts.append(part["text"])
        message["content"] = "\n".join(texts)
    return message


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (assistant-mask markers) and renders the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=16)
def _compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(  # templates come from model repos: untrusted code
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _find_chat_template(model_dir: str, config_template: str | list | None) -> str | None:
    # transformers >= 4.43 saves the template as chat_template.jinja, which then takes precedence.
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    if isinstance(config_template, list):  # older format: named templates; serving uses the default one
        named = {t["name"]: t["template"] for t in config_template}
        return named.get("default")
    return config_template


def _token_content(token: str | dict | None) -> str | None:
    # Configs store a special token as a string or as a serialized AddedToken.
    return token["content"] if isinstance(token, dict) else token


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
