"""transformers' DeepseekV4ForCausalLM as the numerical oracle: random configs, randomised weights.

transformers' init leaves sinks, position biases, router biases, hash tables and mHC base/scale
constant; ``randomise_hf`` gives every tensor random values before the model is saved.
"""

from __future__ import annotations

import torch


def hf_config(**kw):
    from transformers import DeepseekV4Config

    base = dict(
        vocab_size=512,
        hidden_size=128,
        moe_intermediate_size=64,
        num_attention_heads=4,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        index_n_heads=16,
        index_head_dim=128,
        index_topk=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        num_hash_layers=1,
        hc_mult=2,
        rope_scaling={
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    base.update(kw)
    ratios = base.pop("compress_ratios")
    return DeepseekV4Config(num_hidden_layers=len(ratios), compress_ratios=ratios, **base)


def _value(name: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    def normal(std, mean=0.0):
        return torch.randn(p.shape, generator=gen) * std + mean

    if name.endswith("tid2eid"):
        num_experts = int(p.max().item()) + 1 if p.numel() else 1
        raise AssertionError(f"hash tables are set by randomise_hf, not here ({num_experts})")
    if name.endswith(("norm.weight", "layernorm.weight")):
        return normal(0.1, 1.0)
    if name.endswith("sinks"):
        return normal(1.0)
    if name.endswith("position_bias"):
        return normal(0.5)
    if name.endswith("e_score_correction_bias"):
        return normal(0.1)
    if name.endswith(("hc.scale", "hc_scale")):
        return torch.rand(p.shape, generator=gen) + 0.5
    if name.endswith(("hc.base", "hc_base")):
        return normal(0.5)
    if name.endswith(("hc.fn", "hc_fn")):
        return normal(0.02)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name.endswith("lm_head.weight"):
        return normal(3 * p.shape[-1] ** -0.5)
    return normal(p.shape[-1] ** -0.5)


@torch.no_grad()
def randomise_hf(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_experts = model.config.n_routed_experts
    named = list(model.named_parameters()) + list(model.named_buffers())
    for name, p in named:
        if "inv_freq" in name:
            continue
        if name.endswith("tid2eid"):
            rows = [
                torch.randperm(num_experts, generator=gen)[: p.shape[1]] for _ in range(p.shape[0])
            ]
            p.copy_(torch.stack(rows))
        else:
            p.copy_(_value(name, p, gen))


def make_hf_checkpoint(out_dir, seed: int = 0, **config_kw):
    """Saves a randomised transformers model to out_dir; returns the model (eval, fp32)."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config(**config_kw)).eval()
    randomise_hf(model, seed)
    model.save_pretrained(out_dir)
    return model


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy loop over the reference's incremental path."""
    state = model.new_state(1)
    logits = model.step(torch.tensor([prompt]), state)[0, -1]
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model.step(torch.tensor([[out[-1]]]), state)[0, -1]
    return out


def _random_rope_entry(rng, kind: str, prf: bool) -> dict:
    """kind: default, linear, yarn, yarn+attention_factor or yarn+mscale."""
    kind, _, extra = kind.partition("+")
    entry = {"rope_type": kind}
    if rng.random() < 0.8:
        entry["rope_theta"] = rng.choice([10000.0, 160000.0, rng.uniform(500.0, 2e6)])
    if prf:
        entry["partial_rotary_factor"] = 0.125
    if kind == "linear":
        entry["factor"] = rng.uniform(1.0, 8.0)
    if kind == "yarn":
        entry["factor"] = rng.choice([2.0, 16.0, rng.uniform(1.5, 64.0)])
        entry["original_max_position_embeddings"] = rng.choice([2048, 4096, 65536])
        if rng.random() < 0.5:
            entry["beta_fast"], entry["beta_slow"] = rng.uniform(8, 64), rng.uniform(0.5, 2)
    if extra == "attention_factor":
        entry["attention_factor"] = rng.uniform(0.5, 1.5)
    elif extra == "mscale":
        entry["mscale"], entry["mscale_all_dim"] = rng.uniform(0.5, 1.5), rng.uniform(0.3, 1.0)
    return entry


ROPE_KINDS = ("default", "linear", "yarn", "yarn+attention_factor", "yarn+mscale")


def random_rope_fields(rng, spelling: str, compress_kind: str) -> dict:
    """Random RoPE config fields with the compress table of ``compress_kind`` (ROPE_KINDS), in
    one of three spellings: official flat ``rope_scaling``, a flat ``rope_parameters``, or
    transformers' nested ``rope_parameters`` (main / compress; main gets a random kind)."""
    fields = {"rope_theta": rng.uniform(1000.0, 50000.0)}
    if rng.random() < 0.5:
        fields["compress_rope_theta"] = rng.uniform(10000.0, 500000.0)
    if spelling == "nested":
        fields["rope_parameters"] = {
            "main": _random_rope_entry(rng, rng.choice(ROPE_KINDS), True),
            "compress": _random_rope_entry(rng, compress_kind, True),
        }
    else:
        entry = _random_rope_entry(rng, compress_kind, False)
        entry["type"] = entry.pop("rope_type")
        fields["rope_scaling" if spelling == "rope_scaling" else "rope_parameters"] = entry
    return fields
