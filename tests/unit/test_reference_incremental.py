"""The incremental path (window + compressor state carried across calls) equals the full forward."""

import pytest
import torch

from dsv4ray.model import load_reference
from dsv4ray.model.tiny import make_tiny


def _incremental(model, ids, cuts):
    state = model.new_state(ids.shape[0])
    bounds = [0, *cuts, ids.shape[1]]
    return torch.cat([model.step(ids[:, a:b], state) for a, b in zip(bounds, bounds[1:])], dim=1)


def _assert_equal_path(full, inc):
    assert torch.equal(full.argmax(-1), inc.argmax(-1))
    tol = 1e-4 * full.abs().amax()
    assert (full - inc).abs().amax() <= tol


def test_token_by_token_decode_equals_full_forward(tiny_model):
    # chunk ends around the 4 / 128 / 256 edges, then single tokens across a C128 boundary
    ids = torch.randint(2, 258, (2, 300), generator=torch.Generator().manual_seed(1))
    cuts = [1, 5, 127, 128, 129, 200, 252, *range(253, 262), 290]
    _assert_equal_path(tiny_model(ids), _incremental(tiny_model, ids, cuts))


def test_greedy_loop_equals_full_forward(tiny_model):
    prompt = torch.randint(2, 258, (1, 250), generator=torch.Generator().manual_seed(2))
    state = tiny_model.new_state(1)
    logits = tiny_model.step(prompt, state)
    seq = prompt
    for _ in range(12):  # crosses position 255 -> 256 (C128 entry and page edge)
        nxt = logits[:, -1:].argmax(-1)
        seq = torch.cat([seq, nxt], dim=1)
        logits = tiny_model.step(nxt, state)
    full = tiny_model(seq)
    assert torch.equal(full[:, 249:-1].argmax(-1), seq[:, 250:])


@pytest.mark.parametrize(
    "overrides",
    [
        dict(compress_ratios=[4, 4, 4, 4, 0], index_topk_freq=2),
        dict(
            compress_ratios=[0, 4, 4, 128, 4, 4, 0],
            index_topk_pattern=["compute", "share", "share", "compute"],
        ),
    ],
    ids=["freq2", "pattern"],
)
def test_index_share_incremental_equals_full(tmp_path, overrides):
    cfg_layers = len(overrides["compress_ratios"]) - 1
    path = make_tiny(str(tmp_path), "tiny", seed=5, num_hidden_layers=cfg_layers, **overrides)
    model = load_reference(path, torch.float32)
    assert any(spec.skip_topk for spec in model.cfg.layers)
    ids = torch.randint(2, 258, (1, 280), generator=torch.Generator().manual_seed(5))
    _assert_equal_path(model(ids), _incremental(model, ids, [3, 100, 101, 200, 257]))
