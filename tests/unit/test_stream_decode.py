"""Streaming detokenisation and stop strings against whole-text decoding: the deltas of random
byte streams (split multi-byte UTF-8, invalid bytes, special tokens) concatenate to
``tokenizer.decode(ids)``, and a stop string cuts the text where it first appears in the whole
decoded output, also when it spans token boundaries."""

import random

import pytest

from dsv4ray.engine.output_processor import OutputProcessor
from dsv4ray.engine.request import FinishedRequest
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.text.tokenizer import StreamDecoder, Tokenizer
from dsv4ray.text.tokenizer_files import ROLE_TOKEN_IDS, write_byte_tokenizer

SPECIAL_IDS = [0, 1, *ROLE_TOKEN_IDS.values()]  # bos, eos (skipped), role and think tokens
TEXT = "ab€ 日本語 ✓ 😀 naïve Ωmega\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(str(path))
    return Tokenizer(str(path))


def _byte_ids(data: bytes) -> list[int]:
    return [b + 2 for b in data]  # the tiny tokenizer: byte b is token b + 2


def _random_ids(rng: random.Random) -> list[int]:
    """Valid multi-byte text cut at random byte offsets, random bytes and special tokens."""
    ids = []
    for _ in range(rng.randrange(1, 12)):
        kind = rng.random()
        if kind < 0.5:
            text = TEXT.encode()
            start = rng.randrange(len(text))
            ids += _byte_ids(text[start : start + rng.randrange(1, 12)])
        elif kind < 0.8:
            ids += _byte_ids(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4))))
        else:
            ids.append(rng.choice(SPECIAL_IDS))
    return ids


def _stream(tok, ids: list[int], chunk: int = 1) -> tuple[list[str], str]:
    decoder = StreamDecoder(tok)
    deltas = [decoder.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, decoder.flush()


@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_the_whole_decode(tok, chunk):
    rng = random.Random(chunk)
    for _ in range(300):
        ids = _random_ids(rng)
        deltas, rest = _stream(tok, ids, chunk)
        assert "".join(deltas) + rest == tok.decode(ids)


def test_a_split_character_is_held_back_until_it_is_complete(tok):
    ids = _byte_ids("x😀".encode())
    deltas, rest = _stream(tok, ids)
    assert deltas == ["x", "", "", "", "😀"] and rest == ""
    deltas, rest = _stream(tok, ids[:3])  # the answer ends inside the character
    assert "".join(deltas) == "x" and "x" + rest == tok.decode(ids[:3])


def _run(tok, ids: list[int], params: SamplingParams) -> tuple[str, str, bool]:
    """Feeds ids through an OutputProcessor as the engine does: (final text, streamed text,
    whether a stop string ended it; after that the engine sends no more tokens)."""
    proc = OutputProcessor(tok)
    proc.add("r", [0], params)
    streamed, stopped = "", False
    for token in ids:
        delta, stopped = proc.on_token("r", token, None)
        streamed += delta
        if stopped:
            break
    out = proc.on_finish(FinishedRequest("r", [0], ids, "stop" if stopped else "length", 0))
    return out.text, streamed, stopped


def test_final_text_equals_the_whole_decode_without_stop_strings(tok):
    rng = random.Random(5)
    for _ in range(100):
        ids = _random_ids(rng)
        text, streamed, stopped = _run(tok, ids, SamplingParams(max_tokens=len(ids)))
        assert text == tok.decode(ids) and text.startswith(streamed) and not stopped


def test_stop_strings_cut_at_their_first_appearance_in_the_whole_text(tok):
    rng = random.Random(6)
    stops = ("日本", "✓ 😀", "a", "\n", "Ωm")
    for _ in range(300):
        ids = _random_ids(rng)
        want = tok.decode(ids)
        cut = min((c for c in (want.find(s) for s in stops) if c >= 0), default=None)
        text, streamed, stopped = _run(tok, ids, SamplingParams(stop=list(stops)))
        assert stopped == (cut is not None)
        assert text == (want if cut is None else want[:cut])
        # no delta holds text that a stop string later cut: the stream is the answer, or
        # (a finish by length) its start, the rest arriving with the finished output
        assert streamed == text if stopped else text.startswith(streamed)


@pytest.mark.parametrize("min_tokens", [0, 4])
def test_streamed_text_never_holds_the_start_of_a_stop_string_it_cuts(tok, min_tokens):
    """Stop strings that begin inside one token and end several tokens later, or that a token
    only seems to begin: after every delta the streamed text is the start of the answer."""
    rng = random.Random(7 + min_tokens)
    stops = ('"""', "ab", "\n\ndef ", "aab")
    for _ in range(300):
        data = "".join(rng.choice(['"', "a", "b", "\n", "def ", "x"]) for _ in range(12))
        ids = _byte_ids(data.encode())
        params = SamplingParams(stop=list(stops), min_tokens=min_tokens)
        text, streamed, stopped = _run(tok, ids, params)
        assert streamed == text if stopped else text.startswith(streamed)
        assert text == tok.decode(ids)[: len(text)]


def test_a_stop_string_spanning_many_tokens_is_found(tok):
    ids = _byte_ids(b"long answer, then STOP HERE and more")
    text, streamed, stopped = _run(tok, ids, SamplingParams(stop=["xyz", "STOP HERE"]))
    assert stopped and text == streamed == "long answer, then "


def test_a_byte_fallback_decoder_that_rewrites_earlier_bytes_does_not_break_the_stream(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    pieces = ["[UNK]", "a", "▁", "<0xE2>", "<0xAC>", "<0x41>"]
    hf = HFTokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(str(tmp_path))
    # "A" streams out, then the invalid run "A A E2 AC" decodes as four U+FFFD: the window the
    # stream holds no longer starts with what it handed out
    ids = [pieces.index(p) for p in ["<0x41>", "<0x41>", "<0xE2>", "<0xAC>", "▁", "<0x41>", "a"]]
    text, streamed, stopped = _run(tok, ids, SamplingParams(max_tokens=len(ids)))
    assert text == tok.decode(ids) == "\ufffd" * 4 + " Aa" and streamed.endswith(" Aa")


def test_a_trained_byte_level_bpe_streams_through_its_byte_table(tmp_path):
    """Merged multi-byte tokens, an added token outside the byte alphabet and a special token:
    the byte table (the streaming path of byte-level tokenizers) gives decode()'s text."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, special_tokens=["<s>"])
    hf.train_from_iterator([TEXT * 3, "naïve naïve 日本語 日本 ✓✓ ab ab €€"] * 20, trainer)
    hf.add_tokens([AddedToken("two words ✓", special=False, normalized=False)])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(str(tmp_path))
    assert tok.byte_level
    vocab = hf.get_vocab_size(with_added_tokens=True)
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(vocab + 3) for _ in range(rng.randrange(1, 16))]  # some unknown
        for chunk in (1, 2):
            deltas, rest = _stream(tok, ids, chunk)
            assert "".join(deltas) + rest == tok.decode(ids)


def test_a_stop_token_ends_the_answer_without_its_text(tok):
    """stop_token_ids end the output as stop strings do: the token id is the output's last,
    its text is in neither the answer nor the stream."""
    ids = _byte_ids(b"a, b") + _byte_ids(b";") + _byte_ids(b"c")
    stop_id = _byte_ids(b";")[0]
    proc = OutputProcessor(tok)
    proc.add("r", [0], SamplingParams(stop_token_ids=[stop_id]))
    streamed = "".join(proc.on_token("r", t, None)[0] for t in ids[:5])
    out = proc.on_finish(FinishedRequest("r", [0], ids[:5], "stop", 0))
    assert out.text == streamed == "a, b" and out.token_ids[-1] == stop_id


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(tok):
    """The scheduler ends the request by length as its last token arrives; the stop string
    that token completes makes it a stop, with the text cut, as any other stop."""
    ids = _byte_ids(b"x = 1 # end")
    proc = OutputProcessor(tok)
    proc.add("r", [0], SamplingParams(max_tokens=len(ids), stop=["# end"]))
    streamed = "".join(proc.on_token("r", t, None)[0] for t in ids)
    out = proc.on_finish(FinishedRequest("r", [0], ids, "length", 0))
    assert (out.text, streamed, out.finish_reason) == ("x = 1 ", "x = 1 ", "stop")


@pytest.fixture(scope="module")
def spm_tok(tmp_path_factory):
    """A SentencePiece-style tokenizer (Llama's decoder: spaces as ▁, byte fallback, the text's
    first space stripped)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    pieces = ["<unk>", "<s>", "</s>", "▁hello", "▁world", "!", "▁", "ab", "▁x"]
    pieces += [f"<0x{b:02X}>" for b in "日€".encode()]
    hf = HFTokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    hf.add_special_tokens(["<s>", "</s>"])
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    path = tmp_path_factory.mktemp("spm")
    hf.save(str(path / "tokenizer.json"))
    tok = Tokenizer(str(path))
    assert not tok.byte_level
    return tok, {p: i for i, p in enumerate(pieces)}


def _run_after(tok, prompt: list[int], ids: list[int]) -> tuple[str, str]:
    proc = OutputProcessor(tok)
    proc.add("r", prompt, SamplingParams(max_tokens=len(ids)))
    streamed = "".join(proc.on_token("r", t, None)[0] for t in ids)
    return proc.on_finish(FinishedRequest("r", prompt, ids, "length", 0)).text, streamed


def test_an_answer_keeps_the_space_its_first_token_has_after_the_prompt(spm_tok):
    """decode(["▁world"]) alone is "world": after a prompt the answer is " world!", in the
    stream and in the final text, as prompt + answer decode together."""
    tok, ids = spm_tok
    prompt, answer = [ids["<s>"], ids["▁hello"]], [ids["▁world"], ids["!"]]
    text, streamed = _run_after(tok, prompt, answer)
    whole = tok.decode(prompt + answer)
    assert text == streamed == " world!" == whole[len(tok.decode(prompt)) :]
    # a prompt of special tokens alone has no text: the answer starts the text, unstripped
    # by nothing before it, as the whole decode does
    text, streamed = _run_after(tok, [ids["<s>"]], answer)
    assert text == streamed == tok.decode([ids["<s>"], *answer]) == "world!"


def test_sentencepiece_answers_stream_to_their_text_after_the_prompt(spm_tok):
    """Random prompts (at most CONTEXT_TOKENS tokens, so the context is the whole prompt) and
    answers of words, spaces, whole multi-byte characters in byte pieces and special tokens:
    the stream, the final text and the whole decode past the prompt agree (a prompt cut inside
    a character decodes its answer alone)."""
    from dsv4ray.text.tokenizer import CONTEXT_TOKENS

    tok, ids = spm_tok
    words = ["▁hello", "▁world", "!", "▁", "ab", "▁x", "<s>", "</s>"]
    chars = [[f"<0x{b:02X}>" for b in c.encode()] for c in "日€"]
    rng = random.Random(11)
    for _ in range(200):

        def pick(n):  # noqa: E306
            out = []
            for _ in range(n):
                out += rng.choice(chars) if rng.random() < 0.2 else [rng.choice(words)]
            return [ids[p] for p in out]

        prompt, answer = pick(rng.randrange(1, 4))[:CONTEXT_TOKENS], pick(rng.randrange(1, 8))
        text, streamed = _run_after(tok, prompt, answer)
        head, whole = tok.decode(prompt), tok.decode(prompt + answer)
        if head.endswith("\ufffd"):  # the prompt ends inside a character: the answer alone
            assert text == streamed == tok.decode(answer), (prompt, answer)
        else:
            assert text == streamed == whole[len(head) :], (prompt, answer)
