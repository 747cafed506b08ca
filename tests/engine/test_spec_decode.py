"""Speculative decoding with the MTP draft worker in process (fp32 pages): greedy tokens equal the
reference's, every proposal equals the dense MTP block's chain, requests that stop mid-draft end
where plain decoding ends, and seeded sampling gives the tokens of plain sampling.

Checkpoints: the random `tiny` one (window-only draft layer), a random one whose draft layer is
DSA-style (last compress_ratios entry 4: it reuses the target's top-k) and the trained
stdlib-tiny, whose drafts are mostly accepted (a copy whose tokenizer's eos is the newline, so
that eos stops it mid-draft).
"""

import json
import os
import shutil

import pytest
import torch

from dsv4ray.engine.plan import PENDING_DRAFT
from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.llm import LLM
from dsv4ray.model import load_reference
from dsv4ray.model.tiny import make_tiny
from tests.engine.skipped_drafts import watch_skipped_drafts
from tests.oracle import (
    grammar_greedy,
    reference_drafts,
    reference_greedy,
    sampled_tokens,
    sampling_row,
)

TRAINED = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "stdlib-tiny")
CODE = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n\nclass Config:\n    def __init__(se"]


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def dsa_ckpt(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dsa"))
    return make_tiny(out, "tiny", seed=1, compress_ratios=[0, 4, 128, 4, 4, 128, 4])


@pytest.fixture(scope="module")
def trained_ckpt(tmp_path_factory):
    """stdlib-tiny with eos = the newline token (the model never writes its own eos)."""
    out = tmp_path_factory.mktemp("trained")
    for name in os.listdir(TRAINED):
        shutil.copy(os.path.join(TRAINED, name), out / name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "Ċ"}))
    return str(out)


def _engine(ckpt, k):
    return LLM(ckpt, kv_cache_dtype="fp32", speculative_num_steps=k, use_ray=False)


def _run_checking_drafts(llm, ref, prompts, max_tokens, k):
    """Steps the engine; after every step each running request's proposals must equal the
    reference MTP chain after its tokens (max_tokens: one for all, or one per prompt). Returns
    the outputs."""
    core = llm.core
    ids = [f"spec-{i}" for i in range(len(prompts))]
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    for req_id, prompt, n in zip(ids, prompts, max_tokens):
        core.add_request(req_id, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    num_checked = num_pending = 0
    while core.has_unfinished():
        core.step()
        for req_id in ids:
            if not core.outputs.outputs[req_id].finished:
                req = core.scheduler.get_request(req_id)
                drafts = req.draft_token_ids
                if drafts[:1] == [PENDING_DRAFT]:  # still on the device: the next plan fills them
                    drafts = core.pending_drafts.result()[req_id]
                    num_pending += 1
                if drafts:
                    assert drafts == reference_drafts(ref, req.token_ids, k)
                    num_checked += 1
    assert num_checked >= len(prompts)
    assert num_pending > 0  # in process, plans took drafts the host had not read yet
    return [core.pop_output(req_id) for req_id in ids]


@pytest.mark.parametrize(
    "kind,k", [("window", 1), ("dsa", 2), ("trained", 3)], ids=["window-k1", "dsa-k2", "trained-k3"]
)
def test_greedy_equals_reference_and_drafts_equal_the_mtp_chain(
    request, tiny_ckpt, dsa_ckpt, trained_ckpt, kind, k
):
    ckpt = {"window": tiny_ckpt, "dsa": dsa_ckpt, "trained": trained_ckpt}[kind]
    ref = request.getfixturevalue("tiny_model") if kind == "window" else load_reference(ckpt)
    llm = _engine(ckpt, k)
    try:
        # decodes cross the 128 and 256 edges (windows, C128 blocks, pages, snapshots)
        prompts = [llm.core.prompt_ids(p) for p in CODE] if kind == "trained" else []
        prompts += _prompts([3, 124, 250], seed=k)
        outs = _run_checking_drafts(llm, ref, prompts, 10, k)
        stats = llm.core.stats()
        llm.core.check_integrity()
        assert llm.core.scheduler.kv.pages.num_in_use == 0  # rolled-back pages came back
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(ref, prompt, 10)
        assert out.metrics.num_draft_tokens > 0
    assert stats["num_verify_steps"] > 0 and stats["num_failed_draft_passes"] == 0
    if kind == "dsa":  # the draft layer reused the target's top-k at its later steps
        assert stats["num_topk_reuse_rows"] > 0
    if kind == "trained":
        accepted = sum(o.metrics.num_accepted_draft_tokens for o in outs)
        assert accepted > stats["num_verify_steps"] // 2


@pytest.fixture(scope="module")
def trained_llm(trained_ckpt):
    llm = _engine(trained_ckpt, 3)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def trained_ref(trained_ckpt):
    return load_reference(trained_ckpt)


def test_requests_that_stop_mid_draft_end_where_plain_decoding_ends(trained_llm, trained_ref):
    tok = trained_llm.tokenizer
    prompt = tok.encode(CODE[0])  # its answer opens a docstring: a newline comes early
    ref = reference_greedy(trained_ref, prompt, 24)
    eos = tok.eos_token_id
    stop_id = ref[5]
    cases = {
        "eos": (SamplingParams(max_tokens=24), ref[: ref.index(eos) + 1], "stop"),
        "stop_id": (
            SamplingParams(max_tokens=24, stop_token_ids=[stop_id], ignore_eos=True),
            ref[: ref.index(stop_id) + 1],
            "stop",
        ),
        "max_tokens": (SamplingParams(max_tokens=6, ignore_eos=True), ref[:6], "length"),
    }
    text = tok.decode(ref)
    stop = text[len(tok.decode(ref[:7])) :][:2]
    cut = next(i for i in range(len(ref)) if stop in tok.decode(ref[: i + 1]))
    stop_params = SamplingParams(max_tokens=24, stop=[stop], ignore_eos=True)
    cases["stop_string"] = (stop_params, ref[: cut + 1], "stop")
    assert eos in ref[1:12], "the precondition: eos (a newline) comes early in the answer"
    outs = trained_llm.generate([prompt] * len(cases), [c[0] for c in cases.values()])
    for (name, (_, tokens, reason)), out in zip(cases.items(), outs):
        assert (out.token_ids, out.finish_reason) == (tokens, reason), name
    assert outs[3].text == text[: text.index(stop)]
    assert sum(o.metrics.num_accepted_draft_tokens for o in outs) > 0


def test_a_stop_inside_accepted_drafts_at_a_page_boundary_keeps_the_pool_whole(
    trained_llm, trained_ref
):
    """A verification step that ends on a page boundary (its prefix snapshot there) and stops
    on an accepted draft before its last: the request ends where plain decoding ends, and no
    snapshot of tokens it does not have reaches the prefix cache (the release raised, the
    call's outputs were lost and the request held its page for good)."""
    import collections
    import inspect
    import json as json_module

    tok, page = trained_llm.tokenizer, trained_llm.core.scheduler.kv.page_size
    text = inspect.getsource(json_module) + inspect.getsource(collections)
    prompts, params, want = [], [], []
    for start in (2100, 2600, 3100):  # code the drafts guess well
        # the first verify step writes the sampled token and 3 drafts up to the boundary
        prompt = tok.encode(text[start : start + 400])[: page - 4]
        ref = reference_greedy(trained_ref, prompt, 6)
        for j in (1, 2):
            prompts.append(prompt)
            params.append(SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=[ref[j]]))
            want.append(ref[: ref.index(ref[j]) + 1])
    outs = trained_llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics.num_accepted_draft_tokens for o in outs) > 0
    stats = trained_llm.core.stats()
    assert stats["num_running"] == 0
    assert stats["num_free_pages"] + stats["num_cached_pages"] == stats["num_pages"]
    trained_llm.core.check_integrity()


def test_a_draft_pass_that_raises_costs_proposals_never_tokens(trained_llm, trained_ref):
    """A draft pass that fails (device OOM, a kernel error) is counted and logged; its step's
    tokens stand, later steps draft again, and the engine keeps serving."""
    draft = trained_llm.core.pipeline.draft
    real, calls = draft.exact_pass, []

    def fails_once(*args):
        calls.append(1)
        if len(calls) == 2:  # the second pass: the request's first decode step
            raise RuntimeError("injected draft failure")
        return real(*args)

    before = trained_llm.core.stats()
    prompt = trained_llm.tokenizer.encode(CODE[1])
    draft.exact_pass = fails_once
    try:
        out = trained_llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    finally:
        draft.exact_pass = real
    stats = trained_llm.core.stats()
    assert out.token_ids == reference_greedy(trained_ref, prompt, 16)
    assert stats["num_failed_draft_passes"] - before["num_failed_draft_passes"] == 1
    assert out.metrics.num_accepted_draft_tokens > 0  # later steps drafted and were accepted
    again = trained_llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert again.token_ids == out.token_ids


@pytest.mark.parametrize("buckets", [False, True], ids=["eager", "static-buckets"])
def test_seeded_sampling_gives_the_tokens_of_plain_sampling(
    trained_llm, trained_ref, trained_ckpt, buckets
):
    """Verification draws each position's token with the noise plain sampling uses there, so a
    seeded request's tokens are those of the plain sampling loop over the reference's logits;
    also when the draft graph's buckets count the accepted drafts on the device."""
    llm = trained_llm
    if buckets:
        llm = _engine(trained_ckpt, 3)
        llm.core.pipeline.workers[0].capture_graphs(4, 4096, 3, capture=False)
        llm.core.pipeline.draft.capture_graphs(4, 4096, capture=False)
    prompt = llm.tokenizer.encode(CODE[0])
    params = [
        SamplingParams(max_tokens=12, temperature=t, top_p=p, seed=s, ignore_eos=True)
        for t, p, s in ((0.8, 1.0, 1), (1.0, 0.9, 2), (0.6, 1.0, 3), (1.2, 0.95, 4))
    ]
    try:
        outs = llm.generate([prompt] * len(params), params)
        num_verified = llm.core.pipeline.draft.graphs.num_verified if buckets else 0
    finally:
        if buckets:
            llm.shutdown()
    assert num_verified > 0 or not buckets
    for sp, out in zip(params, outs):
        row = sampling_row(**{k: v for k, v in sp.to_dict().items() if k != "seed"}, seed=sp.seed)
        state = trained_ref.new_state(1)
        logits, tokens = trained_ref.step(torch.tensor([prompt]), state)[0, -1], []
        for _ in range(12):
            tokens += sampled_tokens(logits[None], [row], [len(prompt) + len(tokens)])
            logits = trained_ref.step(torch.tensor([tokens[-1:]]), state)[0, -1]
        assert out.token_ids == tokens
    assert sum(o.metrics.num_accepted_draft_tokens for o in outs) > 0


def test_sampled_tokens_follow_the_target_distribution(trained_llm, trained_ref):
    """Many seeds, temperature 1: the second token (drawn while verifying the first step's
    drafts), given the commonest first token, follows the reference's next-token probabilities:
    every frequency within 4 standard errors (fixed seeds, so the test is deterministic)."""
    prompt = trained_llm.tokenizer.encode("    def __init__(sel")
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True)
              for s in range(256)]  # fmt: skip
    outs = trained_llm.generate([prompt] * len(params), params)
    assert sum(o.metrics.num_accepted_draft_tokens for o in outs) > 0
    firsts = torch.tensor([o.token_ids[0] for o in outs])
    t1 = int(firsts.mode().values)
    seconds = torch.tensor([o.token_ids[1] for o in outs if o.token_ids[0] == t1])
    probs = torch.softmax(trained_ref(torch.tensor([prompt + [t1]]))[0, -1], dim=-1)
    freq = torch.bincount(seconds, minlength=probs.numel()) / seconds.numel()
    tol = 4 * torch.sqrt(probs * (1 - probs) / seconds.numel()) + 1e-3
    assert seconds.numel() >= 200 and torch.all((freq - probs).abs() <= tol)


def test_a_grammar_verified_on_drafts_gives_the_tokens_of_plain_decoding(
    trained_llm, trained_ref, trained_ckpt
):
    tok = trained_llm.tokenizer
    # no e at even characters, no t at odd ones: a draft's mask depends on the drafts before
    # it (the tokenizer's tokens are characters)
    spec = {"regex": "([^e\\n][^t\\n])*[^e\\n]?"}
    prompts = [tok.encode(c) for c in CODE]
    outs = trained_llm.generate(prompts, SamplingParams(max_tokens=24, structured_output=spec))
    for prompt, out in zip(prompts, outs):
        # the grammar ends with the checkpoint's eos (this copy stops at the newline as well)
        want = grammar_greedy(trained_ref, trained_ckpt, prompt, spec, 24,
                               trained_ref.cfg.eos_token_id)  # fmt: skip
        assert out.token_ids == want
        assert "e" not in out.text[::2] and "t" not in out.text[1::2]
        assert out.metrics.num_draft_tokens > 0
    assert sum(o.metrics.num_accepted_draft_tokens for o in outs) > 0


def test_a_checkpoint_without_mtp_tensors_is_refused_by_name(tiny_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    for name in os.listdir(tiny_ckpt):
        if name != "model.safetensors":
            shutil.copy(os.path.join(tiny_ckpt, name), tmp_path / name)
    tensors = load_file(os.path.join(tiny_ckpt, "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    with pytest.raises(ValueError, match=r"speculative_num_steps=2 .*lacks mtp\.0\."):
        LLM(str(tmp_path), speculative_num_steps=2, use_ray=False)
    with pytest.raises(ValueError, match="speculative_eagle_topk.*tree drafting"):
        LLM(tiny_ckpt, speculative_num_steps=2, speculative_eagle_topk=2, use_ray=False)
    with pytest.raises(ValueError, match="speculative_num_steps"):
        LLM(tiny_ckpt, speculative_num_steps=-1)


def test_logprobs_of_accepted_drafts_are_the_targets(trained_llm, trained_ref):
    prompt = trained_llm.tokenizer.encode(CODE[0])
    out = trained_llm.generate([prompt], SamplingParams(max_tokens=12, logprobs=2, ignore_eos=True))
    out = out[0]
    assert out.metrics.num_accepted_draft_tokens > 0
    logits = trained_ref(torch.tensor([prompt + out.token_ids]))[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits, dim=-1)
    assert len(out.logprobs) == 12
    for pos, (token, lps) in enumerate(zip(out.token_ids, out.logprobs)):
        top = logp[pos].topk(2).indices.tolist()
        assert set(lps) == {token, *top}
        for tok, lp in lps.items():
            assert lp == pytest.approx(float(logp[pos, tok]), abs=1e-4)


def test_tree_drafting_with_top_k_reuse_is_refused(dsa_ckpt):
    with pytest.raises(ValueError, match="DSA-style.*valid only for chain drafting"):
        LLM(dsa_ckpt, speculative_num_steps=2, speculative_eagle_topk=2, use_ray=False)


@pytest.mark.parametrize(
    "kind,k,verify_graphs,draft_len",
    [("window", 3, True, 256), ("dsa", 2, True, 4096), ("window", 2, False, 4096)],
    ids=["window-k3", "dsa-k2", "window-k2-eager-verify"],
)
def test_static_buckets_give_the_tokens_and_drafts_of_eager_steps(
    request, tiny_ckpt, dsa_ckpt, kind, k, verify_graphs, draft_len
):
    """The verification and draft buckets CUDA graphs capture, run eagerly on their static
    buffers (capture=False): slotted rows, pad rows inside a request's block (a request short
    of max_tokens schedules fewer drafts) and pad requests (3 requests in the 4 bucket). After
    a replayed verification the draft buckets take its rows on the device and find the
    accepted drafts themselves; with draft buckets of 256 positions, steps past them settle on
    the host and draft eagerly; after an eager verification they take the accepted rows from
    the host."""
    ckpt = {"window": tiny_ckpt, "dsa": dsa_ckpt}[kind]
    ref = request.getfixturevalue("tiny_model") if kind == "window" else load_reference(ckpt)
    llm = _engine(ckpt, k)
    try:
        pipe = llm.core.pipeline
        if verify_graphs:
            pipe.workers[0].capture_graphs(4, 4096, k, capture=False)
        pipe.draft.capture_graphs(4, draft_len, capture=False)
        prompts, max_tokens = _prompts([5, 126, 254], seed=10 + k), [4, 9, 7]
        outs = _run_checking_drafts(llm, ref, prompts, max_tokens, k)
        graphs = pipe.workers[0].graphs
        verify_replays = sum(graphs.replays.values()) if graphs is not None else 0
        draft_replays = dict(pipe.draft.graphs.replays)
        num_verified = pipe.draft.graphs.num_verified
        stats = llm.core.stats()
        llm.core.check_integrity()
    finally:
        llm.shutdown()
    for prompt, out, n in zip(prompts, outs, max_tokens):
        assert out.token_ids == reference_greedy(ref, prompt, n)
    # the batch shrinks 3 -> 2 -> 1 requests as they finish: every bucket ran
    if verify_graphs:
        assert set(graphs.replays) == {(b, 4096) for b in (1, 2, 4)}
    if draft_len == 4096:
        assert set(draft_replays) == {(b, 4096) for b in (1, 2, 4)}
        # every replayed verification fed the draft graph on the device
        assert num_verified == verify_replays
    else:  # the longest request drafts past 256 positions: settled on the host, then eager
        assert 0 < num_verified < verify_replays
    if kind == "dsa":
        assert stats["num_topk_reuse_rows"] > 0


def test_requests_a_full_budget_skips_keep_their_pending_drafts(tiny_ckpt, tiny_model):
    """66 decodes of 1 + 3 tokens do not fit a 256-token step: a plan that leaves some out reads
    their proposals on the host first (as it does for requests it gives no drafts), and every
    output still equals plain greedy decoding."""
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", speculative_num_steps=3, use_ray=False,
              max_num_batched_tokens=256, max_running_requests=80)  # fmt: skip
    skipped = watch_skipped_drafts(llm.core.scheduler)
    prompts = _prompts([2] * 66, seed=5)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
        llm.core.check_integrity()
    finally:
        llm.shutdown()
    assert max(skipped) > 0  # a plan left out requests whose drafts were pending
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(tiny_model, prompt, 5)
