"""Lossy page formats (fp8, bf16) against the reference: teacher-forced top-1 and KL gates."""

import pytest
import torch

from dsv4ray.entrypoints.llm import LLM


def _kl(ref_logits: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    ref_logp = torch.log_softmax(ref_logits.float(), dim=-1)
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1)


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_teacher_forced_logits_match_reference(tiny_ckpt, tiny_model, kv_dtype):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 258, (n,), generator=g).tolist() for n in (600, 333)]
    llm = LLM(tiny_ckpt, kv_cache_dtype=kv_dtype, max_num_batched_tokens=512)
    try:
        scored = llm.score(prompts)
    finally:
        llm.shutdown()
    for prompt, logp in zip(prompts, scored):
        ref = tiny_model(torch.tensor([prompt]))[0]
        assert logp.shape == ref.shape
        top1 = (logp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        kl = _kl(ref, logp).mean().item()
        assert top1 >= 0.98, top1
        assert kl <= 0.005, kl


def test_fp32_pages_score_equals_reference(tiny_ckpt, tiny_model):
    prompt = torch.randint(2, 258, (300,), generator=torch.Generator().manual_seed(8)).tolist()
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", max_num_batched_tokens=256)
    try:
        for wrong in (prompt, "text", [prompt, "text"]):  # prompts are lists of token ids
            with pytest.raises(ValueError, match="list of prompts"):
                llm.score(wrong)
        logp = llm.score([prompt])[0]
    finally:
        llm.shutdown()
    ref = torch.log_softmax(tiny_model(torch.tensor([prompt]))[0], dim=-1)
    assert (logp - ref).abs().max() <= 1e-4 * ref.abs().max()
