"""The command line a newcomer meets first: make-tiny, generate, a clear error without a model;
the conventional spellings, every engine option as a flag, Serve config files."""

import json
import os

import pytest
import torch

from dsv4ray.__main__ import main
from dsv4ray.config import ModelConfig
from dsv4ray.model import load_reference
from dsv4ray.model.weights import checkpoint_index
from dsv4ray.text.tokenizer import Tokenizer


def test_generate_streams_the_reference_greedy_text(tiny_ckpt, capsys):
    assert main(["generate", "--model", tiny_ckpt, "--max-tokens", "6", "Hi there"]) == 0
    printed = capsys.readouterr().out
    tok = Tokenizer(tiny_ckpt)
    model = load_reference(tiny_ckpt, torch.float32)
    ids = tok.encode("Hi there")
    out = []
    for _ in range(6):
        nxt = int(model(torch.tensor([ids + out]))[0, -1].argmax())
        if nxt == tok.eos_token_id:
            break
        out.append(nxt)
    assert printed == "Hi there" + tok.decode(out) + "\n"


def test_a_prompt_longer_than_the_context_is_one_line_and_the_next_prompt_runs(tiny_ckpt, capsys):
    args = ["generate", "--model", tiny_ckpt, "--max-tokens", "2", "--max-model-len", "300"]
    assert main([*args, "x" * 400, "Hi"]) == 1  # one prompt failed
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err and printed.err.count("prompt refused") == 1
    assert "request '" not in printed.err  # the engine's own id, which the user never saw
    assert "max_model_len is 300" in printed.err
    assert printed.out.splitlines()[-1].startswith("Hi")  # the next prompt was answered


def test_make_tiny_then_generate(tmp_path, capsys):
    assert main(["make-tiny", "--out", str(tmp_path / "m"), "--seed", "4"]) == 0
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    assert main(["generate", "--model", str(tmp_path / "m"), "--max-tokens", "2", "a"]) == 0


def test_missing_checkpoint_says_how_to_make_one(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--model", str(tmp_path / "nothing"), "x"])
    assert stop.value.code == 2  # a usage error
    assert "make-tiny" in capsys.readouterr().err


def test_tokenizer_round_trips_bytes(tiny_ckpt):
    tok = Tokenizer(tiny_ckpt)
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids[0] == 0 and all(2 <= i < 258 for i in ids[1:])
    assert ids[1:] == [b + 2 for b in text.encode()]
    assert tok.decode(ids) == text


def test_serve_help_lists_every_engine_option_with_its_comment():
    import dataclasses

    from dsv4ray.engine.config import EngineConfig
    from dsv4ray.entrypoints.cli import build_parser
    from dsv4ray.entrypoints.cli_options import NOT_FLAGS

    parser = build_parser()
    (serve,) = [a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "serve"]
    text = serve[1].format_help()
    for f in dataclasses.fields(EngineConfig):
        if f.name != "model":  # --model: serve's own flag
            flag = "--" + f.name.replace("_", "-")
            assert (flag in text) == (f.name not in NOT_FLAGS), f.name
    assert "per-step token budget (chunked prefill) [2048]" in text  # the field's comment
    assert "--pipeline-parallel-size" in text and "-pp PP_SIZE" in text


def test_conventional_spellings_reach_the_engine_options(tmp_path):
    from dsv4ray.entrypoints.cli import build_parser
    from dsv4ray.entrypoints.cli_options import engine_options

    parser = build_parser()
    for spelling in ("--pp", "--pipeline-parallel-size", "-pp", "--pp-size"):
        args = parser.parse_args(["serve", "/models/m", spelling, "2"])
        assert (args.model_pos, engine_options(args)) == ("/models/m", {"pp_size": 2})
    args = parser.parse_args(
        ["--log-level", "info", "serve", "--no-enable-prefix-caching", "--use-ray", "true",
         "--memory-fraction", "0.5", "--log-level", "debug", "--max-model-len", "128"]
    )  # fmt: skip
    assert args.log_level == "DEBUG"  # the last one wins, wherever it stands
    assert engine_options(args) == {
        "enable_prefix_caching": False,
        "use_ray": True,
        "memory_fraction": 0.5,
        "max_model_len": 128,
    }
    assert parser.parse_args(["job", "--input", "i", "--output", "o"]).log_level == "WARNING"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--log-level", "chatty"])


def test_serve_config_file_is_read_with_serves_schema(tmp_path):
    from dsv4ray.entrypoints.serve_file import read_serve_file

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    shipped = read_serve_file(os.path.join(root, "deploy", "serve.yaml"))
    assert shipped.args["pp_size"] == 2 and shipped.args["accelerator"] == "auto"
    assert shipped.args["autoscaling_config"]["max_replicas"] == 2
    assert shipped.serve_options["http_options"] == {"host": "127.0.0.1", "port": 8000}
    bad = tmp_path / "bad.yaml"
    app = {"name": "dsv4ray", "import_path": "dsv4ray.entrypoints.serve:build_app"}
    for extra, message in (
        ({"name": "chat"}, "applications.0.name: dsv4ray serve runs its app as 'dsv4ray'"),
        ({"runtime_env": {"pip": ["x"]}}, "applications.0.runtime_env"),
        ({"import_path": "other:app"}, "import_path"),
        ({"deployments": [{"name": "Other", "num_replicas": 2}]}, "deployments.0.name"),
    ):
        bad.write_text(json.dumps({"applications": [{**app, **extra}]}))
        with pytest.raises(ValueError, match=message):
            read_serve_file(str(bad))
    # keys Serve's schema does not define are named, not dropped (a misspelt args served the
    # demo checkpoint)
    for config, where in (
        ({"applications": [{**app, "argz": {"model": "/m"}}]}, "applications.0.argz"),
        ({"proxy_locaton": "HeadOnly", "applications": [app]}, "proxy_locaton"),
        ({"http_options": {"prot": 1}, "applications": [app]}, "http_options.prot"),
        (
            {"applications": [{**app, "deployments": [{"name": "OpenAIDeployment",
                                                        "num_replicaz": 2}]}]},
            "applications.0.deployments.0.num_replicaz",
        ),
    ):  # fmt: skip
        bad.write_text(json.dumps(config))
        with pytest.raises(ValueError, match=f"{where} is not a key of a Serve config"):
            read_serve_file(str(bad))


def test_no_model_means_the_demo_checkpoint_said_loudly(tiny_ckpt, tmp_path, monkeypatch, caplog):
    from dsv4ray.entrypoints.serve_config import ServeSettings

    monkeypatch.delenv("DSV4RAY_MODEL", raising=False)
    (tmp_path / ".tiny").symlink_to(tiny_ckpt)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING"):
        settings = ServeSettings.from_config({"accelerator": "cpu"})
    assert settings.demo_model and "DEMO checkpoint" in caplog.text
    caplog.clear()
    assert not ServeSettings.from_config({"model": tiny_ckpt, "device": "cpu"}).demo_model
    assert "DEMO" not in caplog.text


def test_make_tiny_layers_cycle_the_presets_attention_pattern(tmp_path):
    """--layers changes the depth of any preset: its layers repeat the preset's compression
    pattern (the MTP layer stays dense), and the checkpoint has exactly those layers."""
    assert main(["make-tiny", "--out", str(tmp_path / "m"), "--layers", "8"]) == 0
    cfg = ModelConfig.from_hf(str(tmp_path / "m"))
    assert cfg.compress_ratios == (0, 4, 128, 4, 4, 128, 0, 4, 0)
    index = checkpoint_index(str(tmp_path / "m"))
    stored = {name.split(".")[1] for name in index if name.startswith("layers.")}
    assert stored == {str(i) for i in range(8)}


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "99999"],
        ["serve", "--port", "0"],
        ["serve", "--host", ""],
        ["make-tiny", "--out", "x", "--layers", "0"],
        ["make-tiny", "--out", "x", "--layers", "-1"],
        ["generate", "--model", "", "x"],  # not the default checkpoint in disguise
        ["serve", ""],
        ["serve", "--port", "abc"],
    ],
)
def test_values_no_command_can_use_are_usage_errors(argv, capsys):
    from dsv4ray.entrypoints.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "error: argument" in err and "invalid _" not in err


def test_serve_flags_override_the_config_file(tiny_ckpt, tmp_path, monkeypatch):
    """--api-key replaces the file's api_key_file (both set was an error), --port the file's
    port; without flags the file's values hold."""
    import dsv4ray.entrypoints.serve as serve_module

    seen = {}
    monkeypatch.setattr(serve_module, "run_server",
                        lambda config, host, port, *rest: seen.update(config=config, host=host,
                                                                      port=port) or 0)  # fmt: skip
    key = tmp_path / "key"
    key.write_text("k1\n")
    app = {"name": "dsv4ray", "import_path": "dsv4ray.entrypoints.serve:build_app",
           "args": {"model": tiny_ckpt, "api_key_file": str(key)}}  # fmt: skip
    path = tmp_path / "serve.yaml"
    path.write_text(json.dumps({"http_options": {"port": 8123}, "applications": [app]}))
    assert main(["serve", "--config", str(path)]) == 0
    assert seen["config"]["api_key_file"] == str(key) and seen["port"] == 8123
    assert main(["serve", "--config", str(path), "--api-key", "other", "--port", "8124"]) == 0
    assert seen["config"]["api_key"] == "other" and "api_key_file" not in seen["config"]
    assert seen["port"] == 8124


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_make_tiny_on_a_missing_device_or_an_unwritable_path_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        main(["make-tiny", "--out", str(tmp_path / "m"), "--device", "cuda"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit, match="dsv4ray make-tiny: "):
        main(["make-tiny", "--out", str(tmp_path / "file" / "m")])


def test_a_running_serve_on_another_port_is_named(monkeypatch):
    """serve.start joins a Serve instance already on the cluster and keeps its HTTP options:
    the command finds where it listens, to announce that instead of a port nothing answers."""
    from types import SimpleNamespace

    import ray.serve.context

    from dsv4ray.entrypoints.serve import _running_http

    running = SimpleNamespace(http_config=SimpleNamespace(host="127.0.0.1", port=8123))
    monkeypatch.setattr(ray.serve.context, "_get_global_client", lambda: running)
    assert _running_http("127.0.0.1", 8123) is None
    assert _running_http("127.0.0.1", 8124) == ("127.0.0.1", 8123)

    def no_client():
        raise RuntimeError("no Serve")

    monkeypatch.setattr(ray.serve.context, "_get_global_client", no_client)
    assert _running_http("127.0.0.1", 8124) is None


@pytest.mark.parametrize(
    "flags", [["--pp", "0"], ["--temperature", "-1"], ["--memory-fraction", "0"]]
)
def test_a_bad_option_value_of_generate_is_a_usage_error(tiny_ckpt, flags, capsys):
    assert main(["generate", "--model", tiny_ckpt, *flags, "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4ray: ") and len(err.strip().splitlines()) == 1


def test_ctrl_c_while_a_command_starts_is_one_line_and_exit_130(tiny_ckpt, monkeypatch, capsys):
    import dsv4ray.entrypoints.generate as generate_module

    def starting(*args, **kwargs):  # still importing torch, checking the checkpoint, ...
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_module, "generate", starting)
    assert main(["generate", "--model", tiny_ckpt, "x"]) == 130
    assert capsys.readouterr().err.strip() == "dsv4ray: stopped"


def test_serve_refuses_a_bad_option_before_starting_ray(tiny_ckpt):
    """One line and exit code 2, with no Ray or Serve started and stopped around it; an option
    only some accelerator takes (a GPU share) is left for the cluster to decide."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "dsv4ray", "serve", tiny_ckpt, "--pp", "0"],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "dsv4ray serve: pp_size must be an int in [1, 2**40], got 0"


def test_a_job_refuses_use_ray_values_other_than_true(tiny_ckpt, tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "x"}\n')
    args = ["job", "--model", tiny_ckpt, "--input", str(tmp_path / "in.jsonl"), "--output",
            str(tmp_path / "out.jsonl")]  # fmt: skip
    assert main([*args, "--use-ray", "banana"]) == 2
    assert "use_ray='banana'" in capsys.readouterr().err


def test_serve_usage_errors_exit_2(tiny_ckpt, tmp_path, capsys):
    for argv in (["serve", tiny_ckpt, "--model", str(tmp_path)],
                 ["serve", "--config", str(tmp_path / "missing.yaml")]):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.startswith("dsv4ray serve: ")


def test_serve_checks_options_for_any_accelerator_before_ray(tiny_ckpt):
    from dsv4ray.entrypoints.serve import _check_options

    _check_options({"model": tiny_ckpt, "num_gpus_per_stage": 0.5, "pp_size": 2}, None)
    with pytest.raises(SystemExit) as exit_info:
        _check_options({"model": tiny_ckpt, "memory_fraction": "0.5"}, None)
    assert exit_info.value.code == 2


def test_make_tiny_with_fewer_layers_than_the_presets_hash_layers(tmp_path):
    """The tiny preset routes its first 2 layers by hash; --layers 1 keeps one of them (it was
    refused naming num_hash_layers, which no flag sets)."""
    out = str(tmp_path / "m")
    assert main(["make-tiny", "--out", out, "--layers", "1"]) == 0
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    assert (written["num_hidden_layers"], written["num_hash_layers"]) == (1, 1)
    assert load_reference(out, torch.float32)(torch.tensor([[0, 5, 6]])).isfinite().all()


def test_a_misspelt_model_option_of_a_tiny_preset_is_refused_by_name():
    from dsv4ray.model.tiny import tiny_config

    with pytest.raises(ValueError, match=r"unknown model option 'hiden_size' for the 'tiny'"):
        tiny_config("tiny", hiden_size=64)
    assert tiny_config("tiny", hidden_size=64).hidden_size == 64
