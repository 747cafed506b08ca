"""Overlap scheduling (two plans in flight, lookahead tokens filled on the device) gives exactly
the tokens of plain scheduling: greedy against the reference, stops mid-lookahead, seeded
sampling with logprobs, preemption in small pools, aborts, and no page left behind."""

import pytest
import torch

from dsv4ray.engine.sampling import SamplingParams
from dsv4ray.entrypoints.llm import LLM
from tests.oracle import reference_greedy


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def overlap_llm(tiny_ckpt):
    # a token cap keeps a GPU run's pools small, so the other engines here fit beside it
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", overlap_scheduling=True, max_total_tokens=8192)
    assert llm.core.pipeline.depth == 2
    yield llm
    llm.shutdown()


def _no_leaks(llm):
    llm.core.check_integrity()
    stats = llm.core.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_pages"] + stats["num_cached_pages"] == stats["num_pages"]


def test_greedy_equals_reference_across_page_edges(overlap_llm, tiny_model):
    # decodes that cross the 128 / 256 edges while their next token is already scheduled
    prompts = _prompts([1, 120, 250, 255, 300])
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    outs = overlap_llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(tiny_model, prompt, 9), len(prompt)
        assert out.finish_reason == "length"
    assert overlap_llm.core.scheduler.lookahead_steps > 0
    _no_leaks(overlap_llm)


def test_stops_in_the_middle_of_lookahead_end_like_plain_decoding(tiny_ckpt, overlap_llm):
    prompts = _prompts([40, 70, 5], seed=4)
    plain = LLM(tiny_ckpt, kv_cache_dtype="fp32", overlap_scheduling=False, max_total_tokens=8192)
    try:
        base = plain.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        stops = [
            SamplingParams(max_tokens=12, stop_token_ids=[base[0].token_ids[3]]),
            SamplingParams(
                max_tokens=12,
                stop=[base[1].text[2:4]] if len(base[1].text) > 4 else None,
                ignore_eos=True,
            ),  # fmt: skip
            SamplingParams(max_tokens=1),
        ]
        want = plain.generate(prompts, stops)
    finally:
        plain.shutdown()
    got = overlap_llm.generate(prompts, stops)
    for w, g in zip(want, got):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    _no_leaks(overlap_llm)


def test_stop_strings_found_after_the_next_plan_went_out_end_like_plain_decoding(
    tiny_ckpt, overlap_llm
):
    """A commit submits the next plan before it detokenises the step's tokens, so a request a
    stop string ends has entries in two plans then; it ends with plain decoding's tokens and
    text, the requests beside it run on unchanged, and no page is left behind."""
    prompts = _prompts([40, 70, 5, 90, 130, 17], seed=9)
    plain = LLM(tiny_ckpt, kv_cache_dtype="fp32", overlap_scheduling=False, max_total_tokens=8192)
    try:
        base = plain.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
        # two characters of each even request's own text (the tiny model's bytes are mostly
        # invalid UTF-8, so some hold U+FFFD and may never appear in the streamed text)
        stops = [out.text[2 + i : 4 + i] if i % 2 == 0 else "" for i, out in enumerate(base)]
        params = [SamplingParams(max_tokens=16, ignore_eos=True, stop=[s] if s else None)
                  for s in stops]  # fmt: skip
        want = plain.generate(prompts, params)
    finally:
        plain.shutdown()
    assert any(w.finish_reason == "stop" for w in want)  # a stop string does end a request
    got = overlap_llm.generate(prompts, params)
    for w, g in zip(want, got):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    _no_leaks(overlap_llm)


def test_seeded_sampling_and_logprobs_equal_plain_scheduling(tiny_ckpt, overlap_llm):
    prompts = _prompts([33, 90, 2], seed=5)
    params = [
        SamplingParams(max_tokens=8, temperature=0.9, top_k=30, seed=11, logprobs=2),
        SamplingParams(max_tokens=8, temperature=1.0, top_p=0.8, seed=12, ignore_eos=True),
        SamplingParams(max_tokens=8, logprobs=0, ignore_eos=True),
    ]
    plain = LLM(tiny_ckpt, kv_cache_dtype="fp32", overlap_scheduling=False, max_total_tokens=8192)
    try:
        want = plain.generate(prompts, params)
    finally:
        plain.shutdown()
    got = overlap_llm.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.logprobs == w.logprobs


def test_preemption_in_a_small_pool_keeps_tokens_and_scores_right(tiny_ckpt, tiny_model):
    prompts = _prompts([200, 230, 250, 180], seed=6)
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", overlap_scheduling=True, max_total_tokens=768,
              max_num_batched_tokens=256)  # fmt: skip
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=70, ignore_eos=True))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == reference_greedy(tiny_model, prompt, 70)
        _no_leaks(llm)
        # scored prompts that do not fit the pool together: a preempted one is scored again
        # from its start, and its rows are each position's once
        scored_prompts = _prompts([600, 300], seed=9)
        preemptions = llm.core.stats()["num_preemptions"]
        scored = llm.score(scored_prompts)
        assert llm.core.stats()["num_preemptions"] > preemptions
        for prompt, logp in zip(scored_prompts, scored):
            ref = torch.log_softmax(tiny_model(torch.tensor([prompt]))[0], dim=-1)
            assert logp.shape == ref.shape
            assert (logp - ref).abs().max() <= 1e-4 * ref.abs().max()
        _no_leaks(llm)
    finally:
        llm.shutdown()


def test_an_abort_while_two_steps_run_leaves_the_others_right(overlap_llm, tiny_model):
    prompts = _prompts([50, 60], seed=7)
    core = overlap_llm.core
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(f"abort-{i}", prompt, params)
    for _ in range(3):
        core.step()
    assert core.abort("abort-0") is not None
    core.run_until_done({"abort-1"})
    assert core.pop_output("abort-1").token_ids == reference_greedy(tiny_model, prompts[1], 10)
    core.pop_output("abort-0")
    _no_leaks(overlap_llm)


def test_a_stage_lost_as_a_commit_sends_the_next_plan_keeps_that_commits_tokens(
    overlap_llm, tiny_model, monkeypatch
):
    # With overlap a commit submits the next plan before it hands out its own step's tokens; a
    # dead stage found by that submit ends every request, after those tokens reached the updates
    from dsv4ray.engine.pipeline import PipelineFailure

    core = overlap_llm.core
    submit, sent_in_commit, committed = core.pipeline.submit, [], {}

    def failing_submit(plan):
        if core._fill_in_commit and plan.batch:
            sent_in_commit.append(plan.step_id)
            if len(sent_in_commit) == 3:  # the scheduler has taken the committing step's tokens
                committed.update(
                    {r: core.scheduler._requests[r].num_output_tokens for r in streamed}
                )
                raise PipelineFailure("stage gone")
        return submit(plan)

    monkeypatch.setattr(core.pipeline, "submit", failing_submit)
    prompts = _prompts([30, 45], seed=9)
    streamed: dict[str, list[int]] = {"lost-0": [], "lost-1": []}
    for i, prompt in enumerate(prompts):
        core.add_request(f"lost-{i}", prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    final = {}
    while len(final) < 2:
        for update in core.step():
            streamed[update.request_id] += update.token_ids
            if update.output is not None:
                final[update.request_id] = update.output
    monkeypatch.undo()
    assert len(sent_in_commit) == 3  # the failure came from a submit inside a commit
    for i, prompt in enumerate(prompts):
        out = core.pop_output(f"lost-{i}")
        assert out is final[f"lost-{i}"]
        assert out.finish_reason == "abort" and "stage" in out.error
        # every committed token, the failing commit's own included, is streamed and kept
        assert streamed[f"lost-{i}"] == out.token_ids
        assert len(out.token_ids) == committed[f"lost-{i}"] >= 1
        assert out.token_ids == reference_greedy(tiny_model, prompt, len(out.token_ids))
    _no_leaks(overlap_llm)
    again = overlap_llm.generate([prompts[1]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert again[0].token_ids == reference_greedy(tiny_model, prompts[1], 4)  # rebuilt
