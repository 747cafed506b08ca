"""The dense reference equals transformers' DeepseekV4ForCausalLM (fp32, batch 1, positions 0..)."""

import pytest
import torch

from dsv4ray.model import load_reference
from dsv4ray.model.tiny import make_tiny
from tests.oracle import make_hf_checkpoint, max_rel_err

pytest.importorskip("transformers")

# Flash-style and Pro-style ratio patterns, hc_mult 2 and 4, IndexShare off.
CONFIGS = [
    pytest.param(dict(compress_ratios=[0, 0, 4, 128, 4, 0], hc_mult=4), 437, id="flash-hc4"),
    pytest.param(
        dict(compress_ratios=[128, 128, 4, 128, 4, 128], hc_mult=2, index_topk=8), 512, id="pro-hc2"
    ),
    pytest.param(
        dict(
            compress_ratios=[0, 4, 128, 4, 128, 0],
            hc_mult=2,
            num_attention_heads=8,
            o_groups=4,
            num_hash_layers=2,
            vocab_size=1024,
        ),
        333,
        id="flash-hc2-8heads",
    ),
    pytest.param(
        dict(
            compress_ratios=[128, 4, 128, 4, 4],
            hc_mult=4,
            hidden_size=192,
            index_topk=12,
            n_routed_experts=6,
            num_experts_per_tok=3,
        ),
        600,
        id="pro-hc4-6experts",
    ),
]


@pytest.mark.parametrize("config,prompt_len", CONFIGS)
def test_reference_matches_transformers(tmp_path, config, prompt_len):
    hf = make_hf_checkpoint(tmp_path, seed=prompt_len, **config)
    ours = load_reference(str(tmp_path), torch.float32)
    ids = torch.randint(
        2, ours.cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len)
    )
    with torch.no_grad():
        ref = hf(ids).logits
    got = ours(ids)
    assert max_rel_err(got, ref) <= 1e-4
    # the prompt is long enough that C128 entries exist and the C4 top-k truncates
    assert prompt_len // 128 >= 2 and prompt_len // 4 > ours.cfg.index_topk
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() == 1.0


def test_make_tiny_loads_in_reference_and_transformers(tmp_path):
    from transformers import DeepseekV4ForCausalLM

    path = make_tiny(str(tmp_path), "tiny", seed=3)
    ours = load_reference(path, torch.float32)
    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(2, 258, (1, 320), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    assert max_rel_err(ours(ids), ref) <= 1e-4
    assert ours.draft_block is not None  # make_tiny writes mtp.0.*


def test_tiny_init_is_peaked(tiny_model):
    """KL gates need peaked distributions: mean top-1 probability >= 0.2 on random prompts."""
    ids = torch.randint(2, 258, (2, 200), generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(tiny_model(ids), dim=-1)
    assert probs.amax(-1).mean().item() >= 0.2
