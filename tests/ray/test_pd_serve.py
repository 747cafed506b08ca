"""Prefill/decode disaggregation behind the OpenAI API: one Serve app whose replica owns both
engines (deploy/serve-pd.yaml's shape), with MTP drafts and a host tier, answering like the
colocated engine, with the handoff counters on Ray's Prometheus endpoint."""

import time
from pathlib import Path

import openai
import yaml
from ray import serve

from dsv4ray import LLM, SamplingParams
from dsv4ray.entrypoints.serve import APP_NAME, ServeSettings, startup_line
from tests.ray.test_serve import _total, scrape_dsv4ray_metrics

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-pd"


def test_serve_pd_yaml_builds_a_pd_app(tiny_ckpt):
    (app,) = yaml.safe_load((ROOT / "deploy" / "serve-pd.yaml").read_text())["applications"]
    settings = ServeSettings.from_config({**app["args"], "model": tiny_ckpt, "device": "cpu"})
    assert settings.engine_options["prefill_pp_size"] == app["args"]["prefill_pp_size"] > 0
    assert len(settings.bundles()) == app["args"]["pp_size"]  # the prefill's are its own


def test_a_replica_with_both_engines_answers_like_the_colocated_engine(
    start_server, tiny_ckpt, ray_session
):
    prompt = [3 + i % 250 for i in range(300)]
    local = LLM(tiny_ckpt, kv_cache_dtype="fp32", use_ray=False)
    try:
        want = local.generate([prompt], SamplingParams(max_tokens=6))[0].token_ids
    finally:
        local.shutdown()
    # with MTP drafts on the decode side and a host tier behind both engines
    url = start_server(tiny_ckpt, served_model_name=MODEL, kv_cache_dtype="fp32", prefill_pp_size=1,
                       speculative_num_steps=2, enable_hicache=True)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        got = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        assert got.choices[0].model_extra["token_ids"] == want
        handle = serve.get_app_handle(APP_NAME)
        info = handle.info.remote().result()
        assert info["prefill_pp_size"] == 1
        assert info["prefill_stage_placement_group_id"] != info["placement_group_id"]
        assert "prefill pp 1 -> decode pp 1" in startup_line(info, "127.0.0.1", 8000)
        stats = handle.stats.remote().result()
        assert stats["pd_remote_prefills"] == 1 and stats["pd_local_prefills"] == 0
        assert stats["num_draft_tokens"] > 0 and info["speculative_num_steps"] == 2
        wait_for_metrics(ray_session, stats["pd_transfer_bytes"])
    finally:
        serve.shutdown()


def wait_for_metrics(ray_session, transfer_bytes: int) -> None:
    deadline = time.monotonic() + 40  # Ray exports metrics every few seconds
    while True:
        series = scrape_dsv4ray_metrics(ray_session)
        exported = _total(series, "ray_dsv4ray_pd_transfer_bytes_total")
        if exported == transfer_bytes and _total(series, "ray_dsv4ray_pd_remote_prefills_total"):
            return
        assert time.monotonic() < deadline, series
        time.sleep(1)
