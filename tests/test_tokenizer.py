"""Tokenizer, chat templates and streaming detokenization, checked against transformers as the oracle."""

import json
import pathlib
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pdserve.engine.detokenizer import IncrementalDetokenizer, StopChecker, find_stop
from pdserve.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, render_chat_template

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 after training

# Qwen2.5's template: whitespace-controlled blocks, tools, tool calls through `tojson`.
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# No `-` modifiers: output depends on trim_blocks/lstrip_blocks; also bos_token, loop controls, the generation tag.
PLAIN_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'ignored' %}
        {% continue %}
    {% endif %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] | tojson }}{% endgeneration %}<|im_end|>
    {% else %}
{{ message['content'] }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief. 简短."},
        {"role": "user", "content": "What is <b>2+2</b>?"},
        {"role": "assistant", "content": "4 😀 \"quoted\" & <tag>"},
        {"role": "user", "content": "And 日本語?"},
    ],
    [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"wind": "3 m/s"}'},
        {"role": "assistant", "content": "21 °C, light wind."},
    ],
]

TEXTS = [
    "",
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "  leading and trailing spaces  \n\ttabs\n",
    "日本語のテキスト と 中文 混合 text",
    "emoji 😀🚀🧑‍🚀 and flags 🇫🇷",
    "rare chars never trained: 龘 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ ☃",
    "café naïve Ελληνικά привет",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]


def _train_tokenizer() -> HFTokenizer:
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog serving prefill decode expert router cache block token".split()
    words += ["日本語", "中文", "모델", "café", "naïve", "😀", "🚀", "Ελληνικά", "привет"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 15))) for _ in range(400)]
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    return tok


def _write_model_dir(path, tok: HFTokenizer, config: dict, generation_config: dict | None = None) -> str:
    tok.save(str(path / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, **config}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return str(path)


@pytest.fixture(scope="module")
def trained() -> HFTokenizer:
    return _train_tokenizer()


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, trained) -> str:
    """A Qwen-style model dir: no BOS, eos <|im_end|>, generation_config adding <|endoftext|>."""
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": QWEN_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    return _write_model_dir(tmp_path_factory.mktemp("qwen"), trained, config, {"eos_token_id": [2, 0]})


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory, trained) -> str:
    """A Llama-style model dir: BOS added on encode, a block-style template without whitespace control."""
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
        "chat_template": PLAIN_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    return _write_model_dir(tmp_path_factory.mktemp("bos"), trained, config, {"eos_token_id": 2})


def _oracle(model_dir: str):
    config = json.loads((pathlib.Path(model_dir) / "tokenizer_config.json").read_text())
    if "add_bos_token" not in config:
        return AutoTokenizer.from_pretrained(model_dir)
    # from_pretrained drops add_bos_token next to tokenizer.json (only model-specific classes such as Llama's
    # honour it); passed explicitly, transformers rebuilds the post-processor as pdserve does.
    return PreTrainedTokenizerFast(
        tokenizer_file=str(pathlib.Path(model_dir) / "tokenizer.json"),
        bos_token=config["bos_token"]["content"],
        eos_token=config["eos_token"],
        add_bos_token=config["add_bos_token"],
        chat_template=config["chat_template"],
    )


@pytest.mark.parametrize("fixture", ["qwen_dir", "bos_dir"])
def test_encode_decode_match_transformers(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    tok, hf = load_tokenizer(model_dir), _oracle(model_dir)
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == len(hf)
    for text in TEXTS:
        for add in (True, False):
            ids = tok.encode(text, add_special_tokens=add)
            assert ids == hf.encode(text, add_special_tokens=add), (text, add)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    rng = random.Random(1)
    for _ in range(50):  # arbitrary ids: partial characters, stray special tokens
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 20))]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_special_token_ids(qwen_dir, bos_dir):
    qwen = load_tokenizer(qwen_dir, eos_token_ids=[5])
    assert qwen.bos_token_id is None
    assert qwen.eos_token_ids == [0, 2, 5]  # tokenizer_config, generation_config and config.json, deduplicated
    assert qwen.encode("hi")[0] != 0
    bos = load_tokenizer(bos_dir)
    assert bos.bos_token_id == 0 and bos.eos_token_ids == [2]
    assert bos.encode("hi")[0] == 0 and bos.encode("hi", add_special_tokens=False)[0] != 0


@pytest.mark.parametrize("fixture", ["qwen_dir", "bos_dir"])
def test_chat_template_matches_transformers(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    tok, hf = load_tokenizer(model_dir), _oracle(model_dir)
    chats = CHATS if fixture == "qwen_dir" else [CHATS[0], CHATS[1], CHATS[1][:1] + [{"role": "ignored"}]]
    special = {"bos_token": tok.bos_token, "eos_token": tok.eos_token}
    for chat in chats:
        expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(chat) == expected
        expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
        assert render_chat_template(tok.chat_template, chat, False, special) == expected


# Qwen3's switch: an empty think block when thinking is off; tools listed in a system turn.
THINKING_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\n# Tools\n' }}
{%- for tool in tools %}{{- tool | tojson }}{{- '\n' }}{%- endfor %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_chat_template_variables_match_transformers(tmp_path, trained):
    config = {"eos_token": "<|im_end|>", "chat_template": THINKING_TEMPLATE}
    model_dir = _write_model_dir(tmp_path, trained, config)
    tok, hf = load_tokenizer(model_dir), _oracle(model_dir)
    chat = CHATS[0]
    rendered = set()
    for kwargs in ({}, {"tools": TOOLS}, {"enable_thinking": False}, {"enable_thinking": True},
                   {"tools": TOOLS, "enable_thinking": False, "unused_variable": 1}):
        expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kwargs)
        assert tok.apply_chat_template(chat, **kwargs) == expected, kwargs
        rendered.add(expected)
    assert len(rendered) == 4  # tools and enable_thinking each change the prompt (enable_thinking=True is the default)
    assert "<think>" in tok.apply_chat_template(chat, enable_thinking=False)
    assert "get_weather" in tok.apply_chat_template(chat, tools=TOOLS)
    assert tok.apply_chat_template(chat, tools=None) == tok.apply_chat_template(chat)


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "bos_token", "eos_token", "documents",
                                 "raise_exception"])
def test_chat_template_reserved_variables(qwen_dir, key):
    chat = CHATS[0]
    for tok in (load_tokenizer(qwen_dir), ByteTokenizer()):
        with pytest.raises(ValueError, match=rf"chat_template_kwargs: '{key}' is set by pdserve"):
            tok.apply_chat_template(chat, **{key: "x"})


def test_chat_content_parts_are_joined(qwen_dir):
    tok = load_tokenizer(qwen_dir)
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    plain = [{"role": "user", "content": "first\nsecond"}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(plain)
    with pytest.raises(ValueError, match="text content parts"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_chat_template_raise_exception(bos_dir):
    with pytest.raises(ValueError, match="unknown role tool"):
        load_tokenizer(bos_dir).apply_chat_template([{"role": "tool", "content": "x"}])


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}.*tokenizer\.json"):
        load_tokenizer(str(tmp_path))


def test_no_chat_template(tmp_path, trained):
    model_dir = _write_model_dir(tmp_path, trained, {"eos_token": "<|im_end|>"})
    tok = load_tokenizer(model_dir)
    assert tok.eos_token_ids == [2]
    with pytest.raises(ValueError, match=r"no chat template.*/v1/completions"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_file_takes_precedence(tmp_path, trained):
    model_dir = _write_model_dir(tmp_path, trained, {"chat_template": "old"})
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert load_tokenizer(model_dir).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_byte_tokenizer():
    tok = load_tokenizer("tiny-moe")
    assert isinstance(tok, ByteTokenizer) and isinstance(load_tokenizer("qwen3-30b-a3b"), ByteTokenizer)
    assert tok.vocab_size == 260 and tok.bos_token_id == 256 and tok.eos_token_ids == [257, 259]
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        if "\u200d" in text:  # a zero-width joiner is no printable character: its bytes' stand-ins
            assert tok.decode(ids, skip_special_tokens=False) == text.replace("\u200d", "âĢį")
        else:
            assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.encode(text) == [256] + ids
    assert tok.encode("a<|im_end|>é", add_special_tokens=False) == [97, 259, 0xC3, 0xA9]
    assert tok.decode([256, 97, 259, 98, 257]) == "ab"
    assert tok.decode([256, 97, 259, 300], skip_special_tokens=False) == "<|bos|>a<|im_end|><|token_300|>"
    assert tok.decode([256, 97, 259, 300]) == "a<|token_300|>"  # past our vocabulary: text, not special
    assert tok.decode([0xE2, 0x82, 97, 0xFF, 0x00, 0xC3]) == "âĤaÿĀÃ"  # incomplete, invalid and control bytes
    assert tok.decode([0xE2, 256, 0x82, 0xAC]) == "€" and tok.decode([0xE2, 256, 0x82, 0xAC], False) == "â<|bos|>Ĥ¬"


def test_byte_tokenizer_decodes_printable_text():
    """A random-weight preset's output reads as characters, never U+FFFD or control characters."""
    tok = load_tokenizer("tiny-moe")
    rng = random.Random(4)
    seen = set()
    for _ in range(300):
        ids = [rng.randrange(512) for _ in range(rng.randint(1, 60))]  # tiny-moe's vocabulary: 512 ids
        ids += [rng.randrange(0x80, 0x100) for _ in range(rng.randint(0, 8))]  # UTF-8 lead/continuation bytes
        rng.shuffle(ids)
        for skip in (True, False):
            text = tok.decode(ids, skip_special_tokens=skip)
            assert all(c.isprintable() or c.isspace() for c in text), repr(text)
            assert "\ufffd" not in text
            seen.update(text)
    assert len(seen) > 250  # every byte reads as some character
    ascii_text = "".join(chr(c) for c in range(32, 127)) + " \t\n\r"
    for text in [ascii_text, "".join(rng.choice(ascii_text) for _ in range(500)), "Hello, world!\n"]:
        assert tok.decode(tok.encode(text)) == text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == "<|bos|>" + text


def test_byte_tokenizer_chat_template():
    tok = ByteTokenizer()
    chat = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi 😀"}]
    expected = "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi 😀<|im_end|>\n"
    assert render_chat_template(tok.chat_template, chat, False, {}) == expected
    assert tok.apply_chat_template(chat) == expected + "<|im_start|>assistant\n"
    # The same signature as Tokenizer's: ChatML uses neither tools nor extra variables.
    assert tok.apply_chat_template(chat, tools=TOOLS, enable_thinking=False) == tok.apply_chat_template(chat)
    ids = tok.encode(tok.apply_chat_template(chat), add_special_tokens=False)
    assert ids.count(258) == 3 and ids.count(259) == 2


def _random_outputs(tok, rng: random.Random, n: int, vocab_size: int) -> list[list[int]]:
    """Output id sequences: encoded text (multi-byte characters split over byte tokens) and arbitrary ids."""
    out = []
    for i in range(n):
        if i % 2:
            text = "".join(rng.choice(TEXTS[1:]) for _ in range(rng.randint(1, 3)))
            out.append(tok.encode(text, add_special_tokens=False))
        else:
            out.append([rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))])
    return out


@pytest.mark.parametrize("fixture", ["qwen_dir", "byte"])
def test_detokenizer_pushes_concatenate_to_full_decode(request, fixture):
    tok = ByteTokenizer() if fixture == "byte" else load_tokenizer(request.getfixturevalue(fixture))
    rng = random.Random(2)
    prompt = tok.encode("日本語 prompt 😀", add_special_tokens=False)
    vocab_size = 512 if fixture == "byte" else tok.vocab_size  # tiny-moe's ids past the byte tokenizer's too
    for ids in _random_outputs(tok, rng, 200, vocab_size):
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, prompt_ids=rng.choice([None, prompt]), skip_special_tokens=skip)
            pieces, i = [], 0
            while i < len(ids):
                step = rng.randint(1, 3)  # several ids per push, as with speculative decoding
                pieces.append(detok.push(ids[i : i + step]))
                i += step
            pieces.append(detok.flush())
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip) == detok.text


def test_detokenizer_holds_back_split_character():
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert detok.push([ord("a")]) == "a"
    assert detok.push([0xE2]) == "" and detok.push([0x82]) == ""  # first two bytes of "€"
    assert detok.push([0xAC]) == "€"
    assert detok.push([0xE2]) == "" and detok.push([ord("b")]) == "âb"  # never completed: the byte's stand-in
    assert detok.push([0xF0]) == "" and detok.flush() == "ð"  # still incomplete at the end
    assert detok.text == "a€âbð"


def test_detokenizer_hf_split_character_and_flush(qwen_dir):
    tok = load_tokenizer(qwen_dir)
    euro = tok.encode("€", add_special_tokens=False)
    assert len(euro) == 3  # not trained: one byte token each
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([t]) for t in euro] == ["", "", "€"]
    assert detok.push(euro[:2]) == "" and detok.flush() == "\ufffd"  # an HF tokenizer's own U+FFFD
    assert detok.text == "€\ufffd"


def test_detokenizer_goes_on_where_decode_stream_refuses(qwen_dir):
    """DecodeStream raises for a decoder that rewrites text it already gave; the detokenizer then
    falls back to decoding its window, and the text still joins to the whole decode."""
    tok = load_tokenizer(qwen_dir)
    ids = tok.encode("Hello there, general Kenobi", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([ids[0]])]

    class Refusing:
        def step(self, tokenizer, token_id):
            raise Exception("Invalid prefix encountered")

    detok._stream._stream = Refusing()  # the next step refuses, as DecodeStream does for such decoders
    pieces += [detok.push([t]) for t in ids[1:]] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids) == detok.text


def test_detokenizer_keeps_leading_space_after_prompt(tmp_path):
    """SentencePiece-style decoders drop the leading space of a sequence's first word; decoded after
    the prompt's last tokens, the first output token keeps it (as the text continues the prompt)."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    hf.decoder = decoders.Metaspace(prepend_scheme="first")
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path))
    assert tok.decode([1, 2, 3]) == "Hello world!" and tok.decode([2, 3]) == "world!"
    detok = IncrementalDetokenizer(tok, prompt_ids=[1])
    assert [detok.push([2]), detok.push([3]), detok.flush()] == [" world", "!", ""]
    assert IncrementalDetokenizer(tok).push([2]) == "world"  # no prompt: the sequence starts there


def test_find_stop():
    assert find_stop("hello world", ["wor", "o"], start=0) == 4
    assert find_stop("hello world", ["world"], start=8) == 6  # match began before start but ends after it
    assert find_stop("hello world", ["xyz"], start=0) is None
    assert find_stop("hello", [], start=0) is None


def _stream(checker: StopChecker, deltas: list[str]) -> tuple[str, bool]:
    out = []
    for delta in deltas:
        text, hit = checker.feed(delta)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + checker.flush(), False


def test_stop_checker_spanning_deltas():
    checker = StopChecker(["STOP"])
    assert checker.feed("abc ST") == ("abc", False)  # " ST" might still become "STOP"
    assert checker.feed("O") == (" ", False)
    assert checker.feed("P tail") == ("", True)
    assert checker.feed("more") == ("", True) and checker.flush() == ""


def test_stop_checker_cases():
    assert _stream(StopChecker(["</s>"]), ["a<", "/", "s", ">b</s>"]) == ("a", True)  # first occurrence
    assert _stream(StopChecker(["\n\n", "END", "x"]), ["one ", "E", "Nd two\n", "\nEND"]) == ("one ENd two", True)
    assert _stream(StopChecker(["long stop", "op"]), ["a long st", "op"]) == ("a ", True)  # earliest start
    assert _stream(StopChecker(["zzz"]), ["no ", "stop ", "z", "z"]) == ("no stop zz", False)  # tail flushed
    assert _stream(StopChecker([]), ["all ", "of it"]) == ("all of it", False)
    assert _stream(StopChecker(["", "!"]), ["hi", "!"]) == ("hi", True)  # empty stop ignored


def test_stop_checker_random_matches_reference():
    rng = random.Random(3)
    for _ in range(300):
        text = "".join(rng.choice("ab\nc") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        hits = [i for s in stops if (i := text.find(s)) != -1]
        expected = (text[: min(hits)], True) if hits else (text, False)
        assert _stream(StopChecker(stops), deltas) == expected, (text, stops, deltas)
