"""The startup warm-up (run on GPUs before serving) leaves the engine as it found it."""

from dsv4ray import LLM, SamplingParams
from dsv4ray.engine.warm_up import warm_up
from tests.oracle import reference_greedy


def test_warm_up_leaves_no_request_page_or_cache_entry_behind(tiny_ckpt, tiny_model):
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp32", max_num_batched_tokens=512)
    try:
        core = llm.core
        before = core.stats()
        warm_up(core)
        after = core.stats()
        assert after["num_free_pages"] == after["num_pages"] == before["num_pages"]
        assert after["num_cached_pages"] == 0 and after["num_running"] == 0
        assert not core.outputs.outputs
        core.check_integrity()
        for worker in core.pipeline.workers:
            assert not worker.tables  # the stages dropped the warm-up requests
        prompt = list(range(2, 300))
        out = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert out.token_ids == reference_greedy(tiny_model, prompt, 4)
        assert out.metrics.num_cached_tokens == 0
    finally:
        llm.shutdown()
