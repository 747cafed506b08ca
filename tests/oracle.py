"""transformers' DeepseekV4ForCausalLM as the numerical oracle: random configs, randomised weights.

transformers' init leaves sinks, position biases, router biases, hash tables and mHC base/scale
constant; ``randomise_hf`` gives every tensor random values before the model is saved.
"""

from __future__ import annotations

import weakref

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


_GREEDY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {prompt: tokens}


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy loop over the reference's incremental path. Runs are kept per model and prompt:
    greedy decoding is deterministic, so n tokens are a prefix of any longer run (the reference
    is the suite's slowest oracle, and parametrised tests ask it the same questions)."""
    runs = _GREEDY.setdefault(model, {})
    key = tuple(prompt)
    if len(runs.get(key, ())) < n:
        runs[key] = model.greedy(list(prompt), n)
    return list(runs[key][:n])


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


def _e4m3fn_value(byte: int) -> float:
    """float8_e4m3fn from its bit fields: sign, 4-bit exponent (bias 7), 3-bit mantissa;
    exponent 0 is subnormal, 0x7f / 0xff are NaN."""
    sign = -1.0 if byte >> 7 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 7
    if exp == 15 and man == 7:
        return float("nan")
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def _e2m1_value(nibble: int) -> float:
    """e2m1 from its bit fields: sign bit 3, 2-bit exponent (bias 1), 1-bit mantissa."""
    sign = -1.0 if nibble >> 3 else 1.0
    exp, man = (nibble >> 1) & 3, nibble & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


_E4M3FN = torch.tensor([_e4m3fn_value(b) for b in range(256)], dtype=torch.float64)
_E2M1 = torch.tensor([_e2m1_value(n) for n in range(16)], dtype=torch.float64)


def decode_e4m3fn(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bytes -> float64, decoded from the bit fields (not through torch's cast)."""
    return _E4M3FN[codes.view(torch.uint8).long()]


def decode_e2m1(nibbles: torch.Tensor) -> torch.Tensor:
    """e2m1 codes 0..15 -> float64, decoded from the bit fields."""
    return _E2M1[nibbles.long()]


def decode_scale(scale: torch.Tensor) -> torch.Tensor:
    """Stored scales -> float64: ue8m0 bytes (float8_e8m0fnu or uint8) mean 2^(b - 127)."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return torch.pow(2.0, scale.view(torch.uint8).double() - 127)
    return scale.double()


def dequantize_float64(weight: torch.Tensor, scale: torch.Tensor, block=(128, 128)):
    """An independent float64 dequantisation of release bytes: fp8 [N, K] with a ceil-div block
    grid of scales, or packed fp4 int8 [N, K / 2] (low nibble = even column) with [N, K / 32]."""
    s = decode_scale(scale)
    if weight.dtype in (torch.int8, torch.uint8):
        raw = weight.view(torch.uint8)
        values = torch.stack((decode_e2m1(raw & 0xF), decode_e2m1(raw >> 4)), -1).flatten(-2)
        return values * s.repeat_interleave(32, dim=1)
    values = decode_e4m3fn(weight)
    rows, cols = values.shape
    grid = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return values * grid[:rows, :cols]


def random_release_tensors(shapes: dict, quant, seed: int = 0) -> dict:
    """Random bytes in the release layout (``dsv4ray.model.release.release_format``) for tensors
    of the given logical shapes: fast, valid codes, no quantisation involved."""
    from dsv4ray.model.release import release_format

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in shapes.items():
        fmt = release_format(name, torch.empty(shape, dtype=dtype, device="meta"), quant)
        base = name[: -len(".weight")]
        if fmt in ("fp8", "fp4"):
            rows, cols = shape
            if fmt == "fp8":
                codes = torch.randint(0, 0x7E, shape, generator=gen, dtype=torch.uint8)
                out[name] = codes.view(torch.float8_e4m3fn)
                block = quant.weight_block_size
                grid = (-(-rows // block[0]), -(-cols // block[1]))
            else:
                out[name] = torch.randint(0, 256, (rows, cols // 2), generator=gen).to(torch.uint8)
                out[name] = out[name].view(torch.int8)
                grid = (rows, cols // 32)
            exps = torch.randint(118, 124, grid, generator=gen, dtype=torch.uint8)
            if fmt == "fp8" and quant.scale_fmt == "float":
                out[base + ".scale"] = torch.pow(2.0, exps.float() - 127.0)
            else:
                out[base + ".scale"] = exps.view(torch.float8_e8m0fnu)
        elif fmt == "int":
            out[name] = torch.randint(0, 2, shape, generator=gen)
        else:
            out[name] = torch.randn(shape, generator=gen).to(
                torch.float32 if fmt == "fp32" else torch.bfloat16
            )
    return out


def sampling_row(seed: int = 7, **params):
    """A validated sampling row of the batched sampler, as the last stage builds it."""
    from dsv4ray import SamplingParams
    from dsv4ray.worker.sampling.sampler import SamplingRow

    return SamplingRow.from_plan(SamplingParams(**params).to_dict(), seed)


def sampled_tokens(logits, rows, positions) -> list[int]:
    """Token ids of one batched sampling pass over logits [R, V] (every row must succeed)."""
    from dsv4ray.worker.sampling.sampler import sample_batch

    out = sample_batch(logits, rows, positions, [None] * len(rows))
    assert all(o.error is None for o in out)
    return [o.token_id for o in out]


def seeded_alone_and_in_a_crowd(llm) -> tuple[list[int], list[int]]:
    """A seeded sampled request's tokens alone, then in a batch beside two other requests."""
    from dsv4ray import SamplingParams

    params = SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    alone = llm.generate(["Sampling alone"], params)[0].token_ids
    crowd = llm.generate(
        ["other prompt", "Sampling alone", "third one"],
        [
            SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True),
            params,
            SamplingParams(max_tokens=3),
        ],
    )[1].token_ids
    return alone, crowd


@torch.no_grad()
def reference_drafts(model, tokens: list[int], k: int) -> list[int]:
    """The MTP block's k chain drafts (top-1) after ``tokens`` on the dense reference: the target
    runs tokens[:-1]; the block runs positions 0 .. n - 2 with the target's pre-head stacks and
    the next tokens (and, DSA-style, the target's last C4 top-k), its last logits giving draft 1;
    draft j + 1 comes from the block at the next position fed its own previous output stack and
    draft j (reusing the last exact position's top-k)."""
    ids = torch.tensor([tokens])
    _, h, topk = model.step(ids[:, :-1], model.new_state(1), return_hidden=True)
    mtp, head, n = model.draft_block, model.head.weight, len(tokens)
    state = mtp.new_state(1)
    nxt = ids[:, 1:]
    logits, x = mtp.draft(h, model.embed(nxt), head, nxt, torch.arange(n - 1), state, topk)
    drafts, x = [int(logits[0, -1].argmax())], x[:, -1:]
    topk = topk[:, -1:] if topk is not None else None
    for j in range(1, k):
        tok = torch.tensor([[drafts[-1]]])
        pos = torch.tensor([n - 2 + j])
        logits, x = mtp.draft(x, model.embed(tok), head, tok, pos, state, topk)
        drafts.append(int(logits[0, -1].argmax()))
    return drafts


def grammar_greedy(ref, ckpt: str, prompt: list[int], spec: dict, n: int, eos: int):
    """Greedy decoding of the reference network under an llguidance matcher of the test's own
    (the grammar's allowed tokens at each step, eos among them where it may end)."""
    from llguidance import LLMatcher, LLTokenizer

    from dsv4ray.engine.structured import grammar

    vocab = ref.cfg.vocab_size
    lltok = LLTokenizer(f"{ckpt}/tokenizer.json", n_vocab=vocab, eos_token=eos)
    matcher, state, out = LLMatcher(lltok, grammar(spec)), ref.new_state(1), []
    logits = ref.step(torch.tensor([prompt]), state)[0, -1].float()
    while len(out) < n and (not out or out[-1] != eos):
        words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
        ok = ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()
        out.append(int(logits.masked_fill(~ok[:vocab], -torch.inf).argmax()))
        assert matcher.consume_token(out[-1])
        logits = ref.step(torch.tensor([[out[-1]]]), state)[0, -1].float()
    return out
