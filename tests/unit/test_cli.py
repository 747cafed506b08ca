"""The command line a newcomer meets first: make-tiny, generate, a clear error without a model."""

import pytest
import torch

from dsv4ray.__main__ import main
from dsv4ray.model import load_reference
from dsv4ray.model.tokenizer import Tokenizer


def test_generate_streams_the_reference_greedy_text(tiny_ckpt, capsys):
    assert main(["generate", "--model", tiny_ckpt, "--max-tokens", "6", "Hi there"]) == 0
    printed = capsys.readouterr().out
    tok = Tokenizer(tiny_ckpt)
    model = load_reference(tiny_ckpt, torch.float32)
    ids = tok.encode("Hi there")
    out = []
    for _ in range(6):
        nxt = int(model(torch.tensor([ids + out]))[0, -1].argmax())
        if nxt == tok.eos_token_id:
            break
        out.append(nxt)
    assert printed == "Hi there" + tok.decode(out) + "\n"


def test_make_tiny_then_generate(tmp_path, capsys):
    assert main(["make-tiny", "--out", str(tmp_path / "m"), "--seed", "4"]) == 0
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    assert main(["generate", "--model", str(tmp_path / "m"), "--max-tokens", "2", "a"]) == 0


def test_missing_checkpoint_says_how_to_make_one(tmp_path):
    with pytest.raises(SystemExit, match="make-tiny"):
        main(["generate", "--model", str(tmp_path / "nothing"), "x"])


def test_tokenizer_round_trips_bytes(tiny_ckpt):
    tok = Tokenizer(tiny_ckpt)
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids[0] == 0 and all(2 <= i < 258 for i in ids[1:])
    assert ids[1:] == [b + 2 for b in text.encode()]
    assert tok.decode(ids) == text
