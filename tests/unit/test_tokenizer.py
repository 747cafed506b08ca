"""Chat rendering: the DeepSeek-V4 format byte for byte (vectors written from the format's
definition in text/chat_encoding.py), jinja templates as transformers renders them, the
reasoning split, and the tiny tokenizer's special tokens."""

import json
import logging

import pytest

from dsv4ray.text.chat_encoding import split_reasoning
from dsv4ray.text.tokenizer import Tokenizer
from dsv4ray.text.tokenizer_files import bytes_to_unicode, write_byte_tokenizer

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(str(path))
    return Tokenizer(str(path))


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text, reasoning=None):
    msg = {"role": "assistant", "content": text}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return msg


SYSTEM = {"role": "system", "content": "Be brief."}
HISTORY = [_user("Hi"), _assistant("Hello!", reasoning="greet back"), _user("2+2?")]
VECTORS = [
    ([_user("Hi")], {}, f"{B}{U}Hi{A}</think>"),
    ([SYSTEM, _user("Hi")], {}, f"{B}Be brief.{U}Hi{A}</think>"),
    ([_user("Hi")], {"thinking": True}, f"{B}{U}Hi{A}<think>"),
    ([SYSTEM, _user("Hi")], {"thinking": False}, f"{B}Be brief.{U}Hi{A}</think>"),
    (HISTORY, {}, f"{B}{U}Hi{A}</think>Hello!{E}{U}2+2?{A}</think>"),
    (HISTORY, {"thinking": True}, f"{B}{U}Hi{A}</think>Hello!{E}{U}2+2?{A}<think>"),
    (
        HISTORY,
        {"thinking": True, "drop_thinking": False},
        f"{B}{U}Hi{A}<think>greet back</think>Hello!{E}{U}2+2?{A}<think>",
    ),
    (
        [SYSTEM, _user("Hi"), _assistant("Hey", reasoning="r")],
        {"thinking": True},
        f"{B}Be brief.{U}Hi{A}<think>r</think>Hey{E}",
    ),
    ([_user("a"), _user("b")], {}, f"{B}{U}a\n\nb{A}</think>"),
    (
        [{"role": "developer", "content": "d"}, *HISTORY],
        {"thinking": True},
        f"{B}{U}Hi{A}</think>Hello!{E}{U}2+2?{A}<think>",
    ),
    (
        [{"role": "developer", "content": "d"}, *HISTORY],
        {},
        f"{B}{U}d{U}Hi{A}</think>Hello!{E}{U}2+2?{A}</think>",
    ),
]


@pytest.mark.parametrize(
    "messages,kwargs,want",
    VECTORS,
    ids=[
        "single",
        "system",
        "thinking",
        "thinking-off",
        "multi-turn",
        "multi-turn-thinking-drops-history",
        "multi-turn-thinking-keeps-history",
        "thinking-assistant-after-last-user",
        "consecutive-users-merge",
        "developer-dropped-in-thinking-history",
        "developer-kept-without-thinking",
    ],
)
def test_dsv4_format_vectors(tok, messages, kwargs, want):
    assert tok.chat_format == "dsv4"
    assert tok.apply_chat_template(messages, chat_template_kwargs=kwargs) == want


MAX_EFFORT = (  # the format's instruction for reasoning_effort "max", as the release writes it
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough "
    "in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\nExplicitly write out your entire deliberation process, documenting "
    "every intermediate step, considered alternative, and rejected hypothesis to ensure "
    "absolutely no assumption is left unchecked.\n\n"
)
PROMPT = f"Be brief.{U}Hi{A}"


@pytest.mark.parametrize(
    "kwargs,want",
    [
        ({"thinking": True, "reasoning_effort": "max"}, f"{B}{MAX_EFFORT}{PROMPT}<think>"),
        ({"enable_thinking": True, "reasoning_effort": "max"}, f"{B}{MAX_EFFORT}{PROMPT}<think>"),
        ({"thinking": True, "reasoning_effort": "high"}, f"{B}Be brief.{U}Hi{A}<think>"),
        ({"reasoning_effort": "max"}, f"{B}Be brief.{U}Hi{A}</think>"),  # no thinking, no effort
    ],
)  # fmt: skip
def test_reasoning_effort_max_opens_a_thinking_prompt_with_its_instruction(tok, kwargs, want):
    assert tok.apply_chat_template([SYSTEM, _user("Hi")], chat_template_kwargs=kwargs) == want


def test_text_parts_render_as_paragraphs(tok):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    from dsv4ray.entrypoints.openai.protocol import ChatMessage

    message = ChatMessage.model_validate({"role": "user", "content": parts}).template()
    assert tok.apply_chat_template([message]) == f"{B}{U}a\n\nb{A}</think>"


def test_no_generation_prompt_and_token_ids(tok):
    assert tok.apply_chat_template([_user("Hi")], add_generation_prompt=False) == f"{B}{U}Hi"
    ids = tok.encode_chat([SYSTEM, _user("Hi")], chat_template_kwargs={"thinking": True})
    text_ids = [b + 2 for b in b"Be brief."]
    assert ids == [0, *text_ids, 258, ord("H") + 2, ord("i") + 2, 259, 260]


@pytest.mark.parametrize(
    "messages,kwargs,match",
    [
        ([{"role": "wizard", "content": "x"}], {}, r"messages\[0\]: role 'wizard'"),
        ([{"role": "user", "content": [{"type": "text"}]}], {}, r"messages\[0\]\.content"),
        ([_user("x")], {"enable_thinkng": True}, "enable_thinkng"),
        ([_user("x")], {"thinking": "yes"}, r"chat_template_kwargs\.thinking"),
        ([_user("x")], {"thinking": True, "enable_thinking": False}, "disagree"),
        ([_user("x")], {"reasoning_effort": "low"}, r"reasoning_effort must be one of"),
    ],
)
def test_dsv4_format_refusals_name_the_field(tok, messages, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages, chat_template_kwargs=kwargs)


def _byte_tokenizer(path, template=None, template_file=None):
    """A byte tokenizer without DeepSeek-V4's role tokens, optionally with a jinja template."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, **{ch: b + 2 for b, ch in bytes_to_unicode().items()}}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<s>", "</s>"])
    hf.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>"}
    if template is not None:
        cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if template_file is not None:
        (path / "chat_template.jinja").write_text(template_file)
    return Tokenizer(str(path))


STRICT = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('tool messages are not supported here') }}{% endif %}"
    "{% if loop.index > 2 %}{% break %}{% endif %}[{{ m['role'] }}]{{ m['content'] | tojson }}"
    "{% endfor %}{% if thinking %}<think>{% endif %}"
)


def test_jinja_template_raise_exception_is_a_clear_value_error(tmp_path):
    tok = _byte_tokenizer(tmp_path, STRICT)
    assert tok.chat_format == "jinja"
    with pytest.raises(ValueError, match="tool messages are not supported here"):
        tok.apply_chat_template([_user("a"), {"role": "tool", "content": "b"}])


def test_a_template_that_does_not_parse_is_said_at_load_and_refuses_chats(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="dsv4ray.model"):
        tok = _byte_tokenizer(tmp_path, "{% for m in messages %}{{ m.content }")
    said = [r.getMessage() for r in caplog.records]
    assert any("does not parse" in m and str(tmp_path) in m for m in said), said
    assert tok.decode(tok.encode("ab", add_bos=False)) == "ab"  # completions still work
    with pytest.raises(ValueError, match="does not parse"):
        tok.apply_chat_template([_user("a")])


def test_jinja_loop_controls_tojson_and_kwargs(tmp_path):
    tok = _byte_tokenizer(tmp_path, STRICT)
    msgs = [_user("é"), _assistant("b"), _user("c")]
    assert tok.apply_chat_template(msgs) == '[user]"é"[assistant]"b"'  # break after two
    assert tok.apply_chat_template(msgs, chat_template_kwargs={"thinking": True}).endswith(
        "<think>"
    )


def test_template_file_named_templates_and_generation_tag(tmp_path):
    for sub in "abc":
        (tmp_path / sub).mkdir()
    body = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    from_file = _byte_tokenizer(tmp_path / "a", template_file=body)
    assert from_file.apply_chat_template([_user("x"), _user("y")]) == "xy"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert _byte_tokenizer(tmp_path / "b", named).apply_chat_template([_user("x")]) == "D"
    plain = _byte_tokenizer(tmp_path / "c")
    assert plain.chat_format == "default"
    assert plain.apply_chat_template([SYSTEM, _user("x")]) == (
        "<s><|system|>Be brief.\n<|user|>x\n<|assistant|>"
    )


@pytest.mark.parametrize(
    "text,want",
    [
        ("let me see</think>4", ("let me see", "4")),
        ("<think>a</think>b</think>c", ("a", "b</think>c")),
        ("still thinking", ("still thinking", "")),
        ("</think>", ("", "")),
    ],
)
def test_split_reasoning(text, want):
    assert split_reasoning(text) == want


def test_reasoning_survives_decoding(tok):
    ids = tok.encode("hmm</think>yes", add_bos=False) + [1]  # ... eos
    assert 261 in ids
    text = tok.decode(ids)
    assert tok.parse_reasoning(text, {"thinking": True}) == ("hmm", "yes")
    assert tok.parse_reasoning(text, {}) == (None, "hmm</think>yes")


def test_without_tokenizer_config_the_models_own_special_ids_count(tiny_ckpt, tmp_path):
    """A checkpoint without tokenizer_config.json: config.json's bos / eos ids are the tokens a
    prompt starts with and generation stops at (without them nothing would stop at eos)."""
    import shutil

    shutil.copy(f"{tiny_ckpt}/tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads(open(f"{tiny_ckpt}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    full, bare = Tokenizer(tiny_ckpt), Tokenizer(str(tmp_path))
    assert (bare.eos_token_id, bare.bos_token_id) == (cfg["eos_token_id"], cfg["bos_token_id"])
    assert (bare.eos_token_id, bare.bos_token_id) == (full.eos_token_id, full.bos_token_id)
    assert bare.encode("hi")[0] == cfg["bos_token_id"]


def test_transformers_encodes_the_tiny_tokenizer_as_the_engine_does(tok, tmp_path):
    """tokenizer_config.json says add_bos_token: transformers' fast tokenizer puts bos first
    as the engine does (its files wrote no post-processor, so it added none)."""
    from transformers import AutoTokenizer

    write_byte_tokenizer(str(tmp_path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ("def f(x):\n    return x", "<｜User｜>hi<｜Assistant｜>", "你好"):
        assert hf(text)["input_ids"] == tok.encode(text)
