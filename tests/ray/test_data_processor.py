"""dsv4ray as a stage of a user's own Ray Data pipeline (read -> map -> processor -> map ->
write) with two engine actors: every row's tokens equal the reference, per-row sampling params
win over the config's, a row that cannot run says why and the others go on."""

import json

import pytest
import ray
import torch

from dsv4ray.data import ProcessorConfig, build_processor
from tests.oracle import reference_greedy


def test_a_users_ray_data_pipeline_runs_the_processor_with_two_replicas(
    ray_session, tiny_ckpt, tiny_model, tmp_path
):
    g = torch.Generator().manual_seed(11)
    rows = [{"n": i, "ids": torch.randint(2, 258, (5 + 9 * i,), generator=g).tolist()}
            for i in range(6)]  # fmt: skip
    rows[2]["max_tokens"] = 2  # this row asks for fewer tokens than the config
    rows.append({"n": 6, "ids": [], "max_tokens": 3})  # an empty prompt: an error for this row
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)

    def preprocess(row):
        params = {"max_tokens": int(row["max_tokens"])} if row.get("max_tokens") else None
        return {"n": row["n"], "prompt": list(row["ids"]), "sampling_params": params}

    def postprocess(row):
        return {"n": int(row["n"]), "tokens": [int(t) for t in row["generated_tokens"]],
                "reason": row["finish_reason"], "error": row["error"]}  # fmt: skip

    config = ProcessorConfig(
        tiny_ckpt,
        concurrency=2,
        batch_size=2,
        sampling_params={"max_tokens": 4, "ignore_eos": True},
        engine_kwargs={"kv_cache_dtype": "fp32"},
    )
    processor = build_processor(config, preprocess=preprocess, postprocess=postprocess)
    processor(ray.data.read_json(str(tmp_path / "in.jsonl"))).write_json(str(tmp_path / "out"))
    got = {}
    for path in (tmp_path / "out").iterdir():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            got[row["n"]] = row
    assert sorted(got) == list(range(7))
    for row in rows[:6]:
        n = row.get("max_tokens", 4)
        assert got[row["n"]]["tokens"] == reference_greedy(tiny_model, row["ids"], n), row["n"]
        assert got[row["n"]]["reason"] == "length" and got[row["n"]]["error"] is None
    assert got[6]["tokens"] == [] and "prompt" in got[6]["error"]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (dict(concurrency=0), "concurrency"),
        (dict(engine_kwargs={"pp_sise": 2}), "pp_sise"),
        (dict(sampling_params={"temprature": 1.0}), "temprature"),
    ],
)
def test_a_bad_processor_config_names_the_field(tiny_ckpt, options, field):
    with pytest.raises((ValueError, TypeError), match=field):
        ProcessorConfig(tiny_ckpt, **options)
