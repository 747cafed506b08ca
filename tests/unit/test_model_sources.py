"""Checkpoints from URIs: copied once per machine into a cache (checked against the hashes taken
while streaming), reused from there, copied again when a cached file is damaged; an engine built
from a file:// URI gives the tokens of the folder; a bad source fails with its name."""

import json
import logging
import os
import shutil

import pytest

from dsv4ray import LLM, SamplingParams
from dsv4ray.sources import MANIFEST, ModelSourceError, fetch_model, is_remote


def test_a_file_uri_is_copied_into_a_fresh_cache_then_reused(tiny_ckpt, tmp_path, caplog):
    uri = "file://" + os.path.abspath(tiny_ckpt)
    cache = str(tmp_path / "cache")
    with caplog.at_level(logging.INFO, logger="dsv4ray.model"):
        local = fetch_model(uri, cache)
    assert local.startswith(cache) and any(": copied" in r.getMessage() for r in caplog.records)
    names = sorted(os.listdir(tiny_ckpt))
    assert sorted(n for n in os.listdir(local) if n != MANIFEST) == names
    for name in names:
        with (
            open(os.path.join(tiny_ckpt, name), "rb") as a,
            open(os.path.join(local, name), "rb") as b,
        ):
            assert a.read() == b.read()
    manifest = json.load(open(os.path.join(local, MANIFEST)))
    assert manifest["source"] == uri and set(manifest["files"]) == set(names)
    stamp = os.stat(os.path.join(local, "config.json")).st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dsv4ray.model"):
        assert fetch_model(uri, cache) == local  # from the cache: nothing copied
        assert fetch_model(uri + "/", cache) == local  # the same folder, not a second copy
    said = [r.getMessage() for r in caplog.records]
    assert any("cached copy" in m for m in said) and not any(": copying" in m for m in said)
    assert os.stat(os.path.join(local, "config.json")).st_mtime_ns == stamp


def test_a_damaged_cached_copy_is_copied_again(tiny_ckpt, tmp_path):
    uri = "file://" + os.path.abspath(tiny_ckpt)
    local = fetch_model(uri, str(tmp_path))
    weights = next(n for n in os.listdir(local) if n.endswith(".safetensors"))
    with open(os.path.join(local, weights), "r+b") as f:
        f.truncate(100)
    assert fetch_model(uri, str(tmp_path)) == local
    with (
        open(os.path.join(tiny_ckpt, weights), "rb") as a,
        open(os.path.join(local, weights), "rb") as b,
    ):
        assert a.read() == b.read()


def test_an_engine_from_a_file_uri_gives_the_folders_tokens(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4RAY_MODEL_CACHE", str(tmp_path))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    tokens = []
    for model in (tiny_ckpt, "file://" + os.path.abspath(tiny_ckpt)):
        llm = LLM(model, kv_cache_dtype="fp32", use_ray=False)
        try:
            tokens.append(llm.generate([[5, 6, 7, 8]], params)[0].token_ids)
        finally:
            llm.shutdown()
    assert tokens[0] == tokens[1]
    assert os.listdir(tmp_path)  # the copy lives in the cache the variable names


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: "file://" + str(p / "missing"), "cannot be opened|is not a folder"),
        (lambda p: "file://" + str(p / "empty"), "has no config.json"),
        (lambda p: "nosuchscheme://bucket/model", "cannot be opened"),
        (lambda p: "nobody-org-xyz/no-such-model", "Hugging Face repository id"),
    ],
)
def test_a_bad_source_fails_with_its_name(tmp_path, monkeypatch, make, words):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "empty").mkdir()
    source = make(tmp_path)
    assert is_remote(source)
    with pytest.raises(ModelSourceError, match=words) as info:
        fetch_model(source, str(tmp_path / "cache"))
    assert source in str(info.value)


def test_local_paths_stay_local(tiny_ckpt):
    assert not is_remote(tiny_ckpt) and fetch_model(tiny_ckpt) == tiny_ckpt
    assert not is_remote("tests/no-such-checkpoint")  # a folder of this checkout: a local path


def test_the_cli_passes_a_uri_on_to_the_engine():
    from dsv4ray.entrypoints.job_input import usage_problem
    from dsv4ray.entrypoints.model_path import model_path

    assert model_path("s3://bucket/ckpt") == "s3://bucket/ckpt"  # fetched where engines start
    problem = usage_problem("gs://bucket/ckpt", "in.jsonl", "out.jsonl", joined=False)
    assert problem is None or "checkpoint" not in problem  # only the input file may be missing


def test_a_finished_copy_in_a_read_only_cache_is_used_and_a_dead_copys_leftovers_go(
    tiny_ckpt, tmp_path
):
    """A shared, read-only model volume: its finished copy is used without taking the lock; a
    partial copy of a process that was killed is removed by the next copy."""
    cache, uri = tmp_path / "cache", f"file://{tiny_ckpt}"
    dest = fetch_model(uri, str(cache))
    os.remove(dest + ".lock")
    os.chmod(cache, 0o555)
    try:
        assert fetch_model(uri, str(cache)) == dest
        assert not os.path.exists(dest + ".lock")  # no lock taken (root writes despite modes)
    finally:
        os.chmod(cache, 0o755)
    other = f"file://{tmp_path}/other"
    os.symlink(tiny_ckpt, tmp_path / "other")
    leftover = (
        os.path.join(cache, os.path.basename(fetch_model(other, str(cache)))) + ".partial-999999999"
    )
    os.makedirs(leftover)
    shutil.rmtree(fetch_model(other, str(cache)))  # the next fetch copies again
    fetch_model(other, str(cache))
    assert not os.path.exists(leftover)


def test_a_cache_that_cannot_take_the_copy_is_one_error_naming_it(tiny_ckpt, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.raises(ModelSourceError, match=r"the copy failed|cannot copy it into the cache"):
        fetch_model(f"file://{tiny_ckpt}", str(blocker / "cache"))
