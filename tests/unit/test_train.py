"""The tiny trainer at micro scale on CPU: the loss falls, a seed fixes the run, and the checkpoint
it writes loads in the reference and in the engine with the reference's greedy tokens."""

import dataclasses
import os
import re
import textwrap

import pytest
import torch

from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.llm import LLM
from dsv4ray.model import load_reference
from dsv4ray.training.corpus import eval_windows, is_held_out, load_corpus
from dsv4ray.training.train import TrainConfig, build_model, evaluate, train, training_logits
from tests.oracle import reference_greedy

MICRO = TrainConfig(
    steps=2, batch_size=2, seq_len=16, warmup_steps=1, log_every=1, eval_windows=2, eval_batch=2
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Micro-scale ops are too small to split: intra-op threads only spin on a busy CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _names(held_out: bool, count: int) -> list[str]:
    names = (f"mod{i}.py" for i in range(10_000))
    return [n for n in names if is_held_out(n) == held_out][:count]


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory) -> str:
    """Three training files, one held-out file, and files in directories the corpus skips."""
    root = tmp_path_factory.mktemp("src")
    source = open(textwrap.__file__, "rb").read()[:4000]
    for name in _names(False, 3) + _names(True, 1):
        (root / name).write_bytes(source)
    for skipped in ("test", "site-packages"):
        (root / skipped).mkdir()
        (root / skipped / "skipped.py").write_bytes(b"SKIPPED = 1\n")
    return str(root)


@pytest.fixture(scope="module")
def trained(corpus_root, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("trained"))
    corpus = load_corpus(corpus_root)
    model, _ = train(MICRO, corpus, out, log_line=lambda _: None)
    return corpus, model, out


def test_corpus_split_and_skipped_dirs(corpus_root):
    corpus = load_corpus(corpus_root)
    assert (corpus.train.num_files, corpus.held_out.num_files) == (3, 1)
    assert corpus.held_out.num_bytes == 4000 and corpus.train.num_bytes == 3 * 4000
    skipped = torch.tensor([b + 2 for b in b"SKIPPED"], dtype=torch.int16)
    for split in (corpus.train, corpus.held_out):
        windows = split.tokens.unfold(0, skipped.numel(), 1)
        assert not (windows == skipped).all(-1).any()


def test_training_forward_is_the_reference_forward():
    model = build_model(seed=1)
    tokens = torch.randint(2, 258, (2, 40), generator=torch.Generator().manual_seed(1))
    main, mtp = training_logits(model, tokens)
    assert main.requires_grad and mtp.shape == main.shape
    torch.testing.assert_close(main, model(tokens[:, :-2]), rtol=1e-5, atol=1e-5)


def test_loss_falls_and_seed_fixes_the_run(trained):
    corpus, model, _ = trained
    windows = eval_windows(corpus.held_out, MICRO.eval_windows, MICRO.seq_len)
    before = evaluate(build_model(MICRO.seed).eval(), windows, MICRO)
    after = evaluate(model, windows, MICRO)
    for head in ("main", "mtp"):
        key = f"{head}_bits_per_byte"
        assert after[key] < before[key] - 0.5, (head, before[key], after[key])
    again, _ = train(MICRO, corpus, None, log_line=lambda _: None)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name


def test_checkpoint_loads_in_reference_and_engine(trained):
    _, model, path = trained
    assert sorted(os.listdir(path)) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "training.json",
    ]
    ref = load_reference(path, torch.float32)
    assert ref.draft_block is not None
    for name, tensor in model.state_dict().items():
        stored = (
            tensor.to(torch.bfloat16) if name.endswith(".weight") and tensor.dim() == 2 else tensor
        )
        assert torch.equal(ref.state_dict()[name], stored.to(tensor.dtype)), name
    llm = LLM(path, kv_cache_dtype="fp32")
    try:
        prompt = llm.core.prompt_ids("def f(n):")
        out = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    finally:
        llm.shutdown()
    assert out.token_ids == reference_greedy(ref, prompt, 6)


def test_num_layers_repeats_the_ratio_pattern_and_is_checked():
    """--num-layers deepens the trained shape: the ratio pattern repeated, the MTP layer last and
    window-only; a depth with no C4 layer to feed top-k is refused by name."""
    model = build_model(seed=0, num_layers=8)
    assert model.cfg.num_hidden_layers == 8
    assert list(model.cfg.layer_ratios) == [0, 4, 128, 4, 4, 128, 0, 4]
    assert model.cfg.mtp_ratio == 0
    with pytest.raises(ValueError, match="num_layers must be >= 2"):
        TrainConfig(num_layers=1)


def test_the_summary_final_loss_is_the_last_logged_window(corpus_root):
    """training.json's final loss is the mean the last progress line logged (its note says so)."""
    lines = []
    cfg = dataclasses.replace(MICRO, steps=3, log_every=2)
    _, summary = train(cfg, load_corpus(corpus_root), None, log_line=lines.append)
    last = next(line for line in reversed(lines) if line.startswith("step 3/3"))
    main, mtp = re.search(r"loss ([\d.]+) bits/byte  mtp ([\d.]+)", last).groups()
    assert [f"{v:.3f}" for v in summary["final_train_loss_bits"]] == [main, mtp]
    assert summary["final_train_loss_note"] == "mean of the last 2 steps (main, MTP), as logged"
