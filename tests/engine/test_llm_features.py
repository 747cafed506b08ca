"""IndexShare checkpoints, seeded sampling and logprobs through the paged engine."""

import json

import pytest
import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.model import load_reference
from dsv4ray.model.tiny import make_tiny
from tests.oracle import reference_greedy, seeded_alone_and_in_a_crowd


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_hidden_layers=5, compress_ratios=[4, 4, 128, 4, 4, 0], index_topk_freq=2),
        dict(
            num_hidden_layers=6,
            compress_ratios=[0, 4, 4, 128, 4, 4, 0],
            index_topk_pattern=["compute", "share", "compute", "share"],
        ),
    ],
    ids=["freq2", "pattern"],
)
def test_index_share_checkpoints_equal_reference(tmp_path, overrides):
    path = make_tiny(str(tmp_path), "tiny", seed=11, **overrides)
    model = load_reference(path, torch.float32)
    assert any(s.skip_topk for s in model.cfg.layers)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 258, (n,), generator=g).tolist() for n in (420, 90)]
    llm = LLM(path, kv_cache_dtype="fp32")
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
        scored = llm.score(prompts)
    finally:
        llm.shutdown()
    for prompt, out, logp in zip(prompts, outs, scored):
        assert out.token_ids == reference_greedy(model, prompt, 5)
        # every position's distribution, not only five argmaxes: a sharing layer that reused
        # another layer's top-k kept most greedy tokens and moved logprobs by up to 1.4
        ref = torch.log_softmax(model(torch.tensor([prompt]))[0], dim=-1)
        assert (logp - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    engine = LLM(tiny_ckpt, kv_cache_dtype="fp32")
    yield engine
    engine.shutdown()


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    alone, crowd = seeded_alone_and_in_a_crowd(llm)
    assert alone == crowd
    other = llm.generate(
        ["Sampling alone"], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)
    )
    assert other[0].token_ids != alone


def test_top_k_one_is_greedy(llm, tiny_model):
    prompt = [0, 70, 80, 90]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0.8, top_k=1, ignore_eos=True)
    )[0]
    assert out.token_ids == reference_greedy(tiny_model, prompt, 6)


def test_logprobs_match_the_reference(llm, tiny_model):
    prompt = [0, 50, 60, 70, 80]
    out = llm.generate([prompt], SamplingParams(max_tokens=3, logprobs=5, ignore_eos=True))[0]
    assert len(out.logprobs) == 3
    seq = prompt + out.token_ids
    ref = torch.log_softmax(tiny_model(torch.tensor([seq]))[0], dim=-1)
    for i, step in enumerate(out.logprobs):
        pos = len(prompt) - 1 + i
        top5 = torch.topk(ref[pos], 5).indices.tolist()
        assert set(top5) <= set(step) and out.token_ids[i] in step
        for tok, lp in step.items():
            assert abs(lp - ref[pos, tok].item()) < 1e-4


@pytest.mark.parametrize("pp", [1, 2])
def test_prompt_logprobs_come_from_the_prefill_and_match_the_reference(tiny_ckpt, tiny_model, pp):
    """Chunked prefills (600 tokens: three chunks) beside a plain request and a cached prefix:
    every prompt token's logprob and rank, and the top n at its position, are the reference
    network's; the prompt is computed whole even when its prefix is cached."""
    g = torch.Generator().manual_seed(8)
    long, short = (torch.randint(2, 258, (n,), generator=g).tolist() for n in (600, 9))
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", pp_size=pp, use_ray=False)
    try:
        llm.generate([long], SamplingParams(max_tokens=1))  # caches the long prompt's prefix
        asked = SamplingParams(max_tokens=2, prompt_logprobs=3, ignore_eos=True)
        outs = llm.generate([long, short, long], [asked, SamplingParams(max_tokens=2), asked])
    finally:
        llm.shutdown()
    assert outs[1].prompt_logprobs is None
    assert outs[0].metrics.num_cached_tokens == 0  # every position computed
    ref = torch.log_softmax(tiny_model(torch.tensor([long]))[0], dim=-1)  # [600, V]
    for out in (outs[0], outs[2]):
        got = out.prompt_logprobs
        assert len(got) == len(long) and got[0] is None
        for pos in range(1, len(long)):
            row = ref[pos - 1]
            (token, lp, rank), *top = got[pos]
            assert token == long[pos] and abs(lp - row[token].item()) < 1e-4
            assert rank == int((row > row[token]).sum()) + 1
            best = torch.topk(row, 3).indices.tolist()
            assert [t for t, _, _ in top] == [t for t in best if t != token]
            assert [r for t, _, r in top] == [best.index(t) + 1 for t, _, _ in top]


def _controlled_greedy(model, prompt: list[int], n: int, params: dict, stop_ids=()) -> list[int]:
    """Greedy decoding of the reference network with the sampling controls applied by the
    element-wise reference of tests/unit/test_logits_processors.py."""
    from tests.unit.test_logits_processors import reference

    state = model.new_state(1)
    logits = model.step(torch.tensor([prompt]), state)[0, -1].float()
    tokens = list(prompt)
    for _ in range(n):
        x = reference(logits, params, tokens, len(prompt), len(tokens), stop_ids)
        tokens.append(int(x.argmax()))
        logits = model.step(torch.tensor([[tokens[-1]]]), state)[0, -1].float()
    return tokens[len(prompt) :]


@pytest.mark.parametrize("pp", [1, 2])
def test_sampling_controls_steer_greedy_decoding_like_the_reference(tiny_ckpt, tiny_model, pp):
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(2, 258, (n,), generator=g).tolist() for n in (40, 7, 130, 60)]
    plain = reference_greedy(tiny_model, prompts[3], 1)
    cases = [  # (params, the ids min_tokens holds back)
        ({"frequency_penalty": 1.5, "presence_penalty": 0.5}, ()),
        ({"repetition_penalty": 1.8, "logit_bias": {7: 2.0, 9: -100.0}}, ()),
        ({"logit_bias": {42: 100.0}}, ()),
        # the plain answer's first token stops the request, but not before 3 tokens
        ({"min_tokens": 3, "stop_token_ids": plain}, tuple(plain)),
    ]
    params = [SamplingParams(max_tokens=10, ignore_eos=True, **p) for p, _ in cases]
    # in process, overlap scheduling on: each step's penalty reads the token drawn just before
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", pp_size=pp, use_ray=False,
              overlap_scheduling=True)  # fmt: skip
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    for prompt, out, (p, stop_ids) in zip(prompts, outs, cases):
        p = {k: v for k, v in p.items() if k != "stop_token_ids"}
        want = _controlled_greedy(tiny_model, prompt, 10, p, stop_ids)
        if stop_ids:  # the stop id ends the request once it may be drawn
            want = want[: want.index(stop_ids[0]) + 1] if stop_ids[0] in want[3:] else want
        assert out.token_ids == want, p
    assert outs[2].token_ids == [42] * 10
    assert len(outs[3].token_ids) > 1 and outs[3].token_ids[0] != plain[0]


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}  # fmt: skip


PICK = {"type": "object", "properties": {"tag": {"enum": ["x", "y"]}, "ok": {"type": "boolean"}},
        "required": ["tag", "ok"]}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "pick", "parameters": PICK}}]


@pytest.mark.parametrize("k", [0, 2])
def test_structured_output_holds_beside_free_requests_and_drafts(tiny_ckpt, tiny_model, k):
    import jsonschema

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 258, (n,), generator=g).tolist() for n in (12, 30, 300)]
    constrained = [
        SamplingParams(max_tokens=120, structured_output={"json": SCHEMA}),
        SamplingParams(
            max_tokens=20,
            temperature=1.0,
            seed=3,
            min_tokens=15,  # longer than either answer: the closed grammar still ends it
            structured_output={"choice": ["alpha", "beta gamma"]},
        ),  # fmt: skip
    ]
    free = SamplingParams(max_tokens=6, ignore_eos=True)
    # in process, overlap scheduling (no drafts) or a draft worker beside the constrained rows
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", use_ray=False, speculative_num_steps=k,
              overlap_scheduling=k == 0)  # fmt: skip
    try:
        outs = llm.generate(prompts, [*constrained, free])
        chatted = llm.chat([{"role": "user", "content": "json?"}], constrained[0])[0]
        # a forced call after the reasoning: a bias forces </think> first, then the grammar
        think_end = llm.tokenizer.think_end_id
        switch = "enable_thinking" if k else "thinking"  # the format's two names for it
        called = llm.chat(
            [{"role": "user", "content": "call"}],
            SamplingParams(max_tokens=400, logit_bias={think_end: 100.0}),
            {switch: True}, TOOLS, "required", False)[0]  # fmt: skip
        stats = llm.core.stats()
    finally:
        llm.shutdown()
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert outs[0].finish_reason == "stop"  # the grammar's end allows only eos
    assert outs[1].text in ("alpha", "beta gamma")
    assert outs[1].finish_reason == "stop" and outs[1].error is None
    assert outs[2].token_ids == reference_greedy(tiny_model, prompts[2], 6)
    jsonschema.validate(json.loads(chatted.text), SCHEMA)
    assert called.token_ids[0] == think_end and called.content is None
    (call,) = called.tool_calls  # parallel_tool_calls=False: the grammar ends after one
    assert call["function"]["name"] == "pick" and called.finish_reason == "stop"
    jsonschema.validate(json.loads(call["function"]["arguments"]), PICK)
    if k:  # the constrained requests drafted too (exactness: tests/engine/test_spec_decode.py)
        assert stats["num_draft_tokens"] > 0
        assert outs[0].metrics.num_draft_tokens > 0 and outs[1].metrics.num_draft_tokens > 0
