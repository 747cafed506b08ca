"""Broken checkpoints: every load failure is one message naming the file and what is wrong, a
ValueError from ``LLM(...)`` (at pp 1 and 2, before any stage starts) and a one-line usage error
with exit code 2 from the CLI."""

import json
import os
import shutil

import pytest

from dsv4ray import LLM
from dsv4ray.entrypoints.cli import main
from dsv4ray.model.release import save_sharded


def _truncate(path: str, keep: float) -> None:
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * keep))


def _edit_json(path: str, edit) -> None:
    with open(path) as f:
        data = json.load(f)
    edit(data)
    with open(path, "w") as f:
        json.dump(data, f)


def _append(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


# (case, the file at fault, what the message says, how to break a copy of the checkpoint)
SINGLE = [
    ("truncated weights", "model.safetensors", "truncated or corrupt",
     lambda d: _truncate(f"{d}/model.safetensors", 0.6)),
    ("header cut", "model.safetensors", "truncated or corrupt",
     lambda d: _truncate(f"{d}/model.safetensors", 0.0001)),
    ("config with trailing junk", "config.json", "not valid JSON",
     lambda d: _append(f"{d}/config.json", "\n}")),
    ("config not an object", "config.json", "must be a JSON object",
     lambda d: open(f"{d}/config.json", "w").write("[1, 2]")),
    ("config field of the wrong type", "config.json", "hidden_size",
     lambda d: _edit_json(f"{d}/config.json", lambda c: c.update(hidden_size="64"))),
    ("config field missing", "config.json", "vocab_size",
     lambda d: _edit_json(f"{d}/config.json", lambda c: c.pop("vocab_size"))),
    ("tokenizer missing", "tokenizer.json", "missing",
     lambda d: os.remove(f"{d}/tokenizer.json")),
    ("tokenizer corrupt", "tokenizer.json", "not a readable tokenizer",
     lambda d: open(f"{d}/tokenizer.json", "w").write('{"model": 5}')),
    ("tokenizer config junk", "tokenizer_config.json", "not valid JSON",
     lambda d: _append(f"{d}/tokenizer_config.json", "junk")),
    ("no weights", "", "no .safetensors file",
     lambda d: os.remove(f"{d}/model.safetensors")),
    ("config with fewer layers", "model.safetensors", "but config.json has num_hidden_layers",
     lambda d: _edit_json(f"{d}/config.json", lambda c: c.update(
         num_hidden_layers=c["num_hidden_layers"] - 1,
         compress_ratios=c["compress_ratios"][:-2] + c["compress_ratios"][-1:]))),
    ("tokenizer past the vocabulary", "tokenizer.json", "past the model's vocab_size",
     lambda d: _edit_json(f"{d}/tokenizer.json", lambda t: t["model"]["vocab"].update(
         {"<big>": 100000}))),
]  # fmt: skip


def _first_shard(d: str) -> str:
    with open(f"{d}/model.safetensors.index.json") as f:
        return sorted(set(json.load(f)["weight_map"].values()))[0]


SHARDED = [
    ("a shard missing", "model-00001-of-", "missing (the shard index names it",
     lambda d: os.remove(f"{d}/{_first_shard(d)}")),
    ("an extra shard", "extra.safetensors", "does not name",
     lambda d: shutil.copy(f"{d}/{_first_shard(d)}", f"{d}/extra.safetensors")),
    ("an index that is not JSON", "model.safetensors.index.json", "not valid JSON",
     lambda d: _append(f"{d}/model.safetensors.index.json", ",")),
    ("an index without a weight map", "model.safetensors.index.json", "weight_map",
     lambda d: _edit_json(f"{d}/model.safetensors.index.json", lambda i: i.pop("weight_map"))),
    ("a shard truncated", "model-00001-of-", "truncated or corrupt",
     lambda d: _truncate(f"{d}/{_first_shard(d)}", 0.5)),
]  # fmt: skip


@pytest.fixture(scope="module")
def sharded_ckpt(tiny_ckpt, tmp_path_factory) -> str:
    """The tiny checkpoint in the release layout: shards and their index."""
    from safetensors.torch import load_file

    path = str(tmp_path_factory.mktemp("sharded") / "ckpt")
    shutil.copytree(tiny_ckpt, path)
    tensors = load_file(f"{path}/model.safetensors")
    os.remove(f"{path}/model.safetensors")
    save_sharded(tensors, path)
    return path


def _broken(source: str, tmp_path, breaks) -> str:
    path = str(tmp_path / "ckpt")
    shutil.copytree(source, path)
    breaks(path)
    return path


def _assert_named(message: str, path: str, file: str, what: str) -> None:
    assert "\n" not in message.strip() and "Traceback" not in message
    named = os.path.join(path, file) if file else path  # a folder-wide problem names the folder
    assert named in message and what in message, message


@pytest.mark.parametrize("case,file,what,breaks", SINGLE + SHARDED,
                         ids=[c[0] for c in SINGLE + SHARDED])  # fmt: skip
def test_a_broken_checkpoint_is_one_message_naming_the_file(
    tiny_ckpt, sharded_ckpt, tmp_path, capsys, case, file, what, breaks
):
    source = sharded_ckpt if (case, file, what, breaks) in SHARDED else tiny_ckpt
    path = _broken(source, tmp_path, breaks)
    for pp in (1, 2):
        with pytest.raises(ValueError) as info:
            LLM(path, pp_size=pp, use_ray=False, kv_cache_dtype="fp32")
        _assert_named(str(info.value), path, file, what)
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--model", path, "hi"])
    assert stop.value.code == 2
    err = capsys.readouterr().err  # may also hold log lines of other tests' Ray actors
    ours = [line for line in err.splitlines() if line.startswith("dsv4ray:")]
    assert len(ours) == 1 and "Traceback" not in err, err
    _assert_named(ours[0], path, file, what)
