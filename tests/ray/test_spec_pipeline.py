"""The MTP draft actor as the last node of a two-stage compiled graph: greedy tokens equal the
reference's with window-only and DSA-style draft layers, and killing the draft actor mid-run
leaves every request exactly right (they resume on the rebuilt pipeline); `dsv4ray job` takes
--speculative-num-steps and reports each request's drafts."""

import json
import os

import pytest
import ray
import torch

from dsv4ray import LLM, SamplingParams
from dsv4ray.model import load_reference
from dsv4ray.model.tiny import make_tiny
from dsv4ray.text.tokenizer import Tokenizer
from tests.oracle import grammar_greedy, reference_greedy, sampled_tokens, sampling_row

TRAINED = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "stdlib-tiny")
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 258, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("draft,k", [("window", 1), ("dsa", 3)])
def test_pp2_with_drafts_gives_the_reference_greedy_tokens(
    ray_session, tiny_ckpt, tiny_model, tmp_path, idle_cpu_s, draft, k
):
    ckpt, model = tiny_ckpt, tiny_model
    if draft == "dsa":
        ckpt = make_tiny(str(tmp_path), "tiny", seed=3, compress_ratios=[0, 4, 128, 4, 4, 128, 4])
        model = load_reference(ckpt, torch.float32)
    prompts = _prompts([3, 124, 250], seed=k)  # decodes cross the 128 and 256 edges
    llm = LLM(ckpt, kv_cache_dtype="fp32", pp_size=2, speculative_num_steps=k)
    try:
        pipeline = llm.core.pipeline
        stage_node = ray.get(pipeline.actors[-1].ready.remote())["node"]
        assert ray.get(pipeline.draft.ready.remote())["node"] == stage_node
        outs = llm.generate(prompts, GREEDY)
        stats = llm.core.stats()
        idle = idle_cpu_s([*pipeline.actors, pipeline.draft], 1.0)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(model, prompt, 10)
    assert max(idle) < 0.3, idle  # stages and draft worker sleep between steps on CPU
    assert stats["num_verify_steps"] > 0 and stats["num_failed_draft_passes"] == 0
    if draft == "dsa":  # its later draft steps reused the target's top-k
        assert stats["num_topk_reuse_rows"] > 0


def test_killing_the_draft_actor_mid_run_leaves_every_request_right(ray_session):
    ref = load_reference(TRAINED, torch.float32)
    llm = LLM(TRAINED, kv_cache_dtype="fp32", pp_size=2, speculative_num_steps=2)
    core = llm.core
    prompts = [core.prompt_ids(p) for p in ("def fibonacci(n):\n", "class A:\n    def f(")]
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
    params = [SamplingParams(max_tokens=24, ignore_eos=True), seeded]
    try:
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            core.add_request(f"r{i}", prompt, sp)
        while min(len(core.outputs.outputs[f"r{i}"].token_ids) for i in range(2)) < 6:
            core.step()
        old_draft = core.pipeline.draft
        ray.kill(old_draft, no_restart=True)
        core.run_until_done({"r0", "r1"})
        outs = [core.pop_output(f"r{i}") for i in range(2)]
        stats = core.stats()
        assert core.pipeline.draft is not None and core.pipeline.draft != old_draft
        core.check_integrity()
    finally:
        llm.shutdown()
    assert [(o.finish_reason, o.error) for o in outs] == [("length", None)] * 2
    assert outs[0].token_ids == reference_greedy(ref, prompts[0], 24)
    row = sampling_row(temperature=0.8, seed=5)
    state, tokens = ref.new_state(1), []
    logits = ref.step(torch.tensor([prompts[1]]), state)[0, -1]
    for _ in range(24):
        tokens += sampled_tokens(logits[None], [row], [len(prompts[1]) + len(tokens)])
        logits = ref.step(torch.tensor([tokens[-1:]]), state)[0, -1]
    assert outs[1].token_ids == tokens
    assert stats["num_pipeline_rebuilds"] == 1 and stats["num_accepted_draft_tokens"] > 0


def test_job_with_drafts_from_the_command_line(ray_session, tmp_path, capsys):
    from dsv4ray.__main__ import main

    ref = load_reference(TRAINED, torch.float32)
    prompts = {"a": "def fibonacci(n):\n", "b": "import os\n\n\ndef main("}
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [
        {"id": i, "prompt": p, "max_tokens": 12, "ignore_eos": True} for i, p in prompts.items()
    ]
    # a grammar verified on the drafts: no e at even characters, no t at odd ones
    regex = "([^e\\n][^t\\n])*[^e\\n]?"
    rows.append({"id": "c", "prompt": prompts["b"], "max_tokens": 12, "structured_output":
                 {"regex": regex}})  # fmt: skip
    src.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["job", "--model", TRAINED, "--input", str(src), "--output", str(dst)]
    assert main([*argv, "--kv-cache-dtype", "fp32", "--speculative-num-steps", "2"]) == 0
    assert "MTP drafts on (2 per step)" in capsys.readouterr().err
    tok = Tokenizer(TRAINED)
    lines = [json.loads(line) for line in dst.read_text().splitlines()]
    for out in lines:
        prompt = tok.encode(prompts.get(out["id"], prompts["b"]))
        want = reference_greedy(ref, prompt, 12) if out["id"] != "c" else grammar_greedy(
            ref, TRAINED, prompt, {"regex": regex}, 12, tok.eos_token_id)  # fmt: skip
        assert out["token_ids"] == want
        assert out["metrics"]["num_draft_tokens"] >= out["metrics"]["num_accepted_draft_tokens"] > 0
    assert sorted(out["id"] for out in lines) == ["a", "b", "c"]
