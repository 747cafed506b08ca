"""Batch job input lines: every SamplingParams field, logit_bias with JSON's string keys, and
the line's problem named; the rows the job's read task streams, in input order, and the
summary's TTFT percentiles."""

import json
import math
import os
import random

import pytest

from dsv4ray.entrypoints.job_input import (
    JobLines,
    JobStats,
    job_rows,
    last_results,
    parse_line,
    sampling_params,
    scan_input,
    usage_problem,
)


def test_a_line_takes_every_sampling_field_and_logit_bias_by_token_id():
    line = json.dumps({"id": 3, "prompt": "hi", "max_tokens": 5, "frequency_penalty": 0.5,
                       "min_tokens": 2, "min_p": 0.1, "logit_bias": {"7": 1.5}})  # fmt: skip
    req_id, item = parse_line(line, 16)
    params = sampling_params(json.loads(json.dumps(item["params"])))  # as a replica reads it
    assert req_id == "3" and params.max_tokens == 5 and params.min_tokens == 2
    assert params.frequency_penalty == 0.5 and params.logit_bias == ((7, 1.5),)


@pytest.mark.parametrize(
    "fields,problem",
    [
        ({"logit_bias": {"x": 1.0}}, "logit_bias keys"),
        ({"presence_penalty": 9}, "presence_penalty"),
        ({"min_tokens": 99}, "min_tokens"),
        ({"typical_p": 0.5}, "unknown field 'typical_p'"),
    ],
)
def test_a_bad_sampling_field_is_the_lines_error_named(fields, problem):
    with pytest.raises(ValueError, match=problem):
        parse_line(json.dumps({"id": 1, "prompt": "hi", **fields}), 16)


def test_a_line_asks_for_json_with_openais_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    messages = [{"role": "user", "content": "hi"}]
    line = json.dumps({"id": "j", "messages": messages, "response_format": response_format})
    _, item = parse_line(line, 16)
    assert sampling_params(item["params"]).structured_output == {"json": schema}
    with pytest.raises(ValueError, match="'response_format'"):
        parse_line(json.dumps({"id": 1, "prompt": "p", "response_format": {"type": "xml"}}), 16)


def test_a_chat_line_carries_tools_and_its_output_row_the_calls():
    from dsv4ray.engine.outputs import RequestOutput
    from dsv4ray.entrypoints.job_replica import output_row
    from dsv4ray.entrypoints.tool_calls import ChatTools
    from dsv4ray.text import dsml

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"}]
    line = {"id": 1, "messages": messages, "tools": tools, "parallel_tool_calls": False}
    _, item = parse_line(json.dumps(line), 16)
    assert (item["tools"], item["parallel_tool_calls"]) == (tools, False)
    chat_tools = ChatTools.from_request(item["tools"], None, item["parallel_tool_calls"])
    text = "ok\n\n" + dsml.render_calls([("f", {"a": 1}), ("f", {})])
    row = output_row("1", RequestOutput("r", [1], [2], text, finish_reason="stop"), chat_tools)
    assert (row["text"], row["content"], row["finish_reason"]) == (text, "ok", "tool_calls")
    assert [json.loads(c["function"]["arguments"]) for c in row["tool_calls"]] == [{"a": 1}]
    bad_lines = [({"prompt": "p", "tools": tools}, "'tools' needs 'messages'"),
                 ({"messages": messages, "tool_choice": "required"}, "tool_choice"),
                 ({"messages": messages, "tools": [{"type": "f"}]}, "tools.0")]  # fmt: skip
    for bad, problem in bad_lines:
        with pytest.raises(ValueError, match=problem):
            parse_line(json.dumps({"id": 1, **bad}), 16)


def test_an_output_row_carries_the_logprobs_a_line_asked_for():
    from dsv4ray.engine.outputs import RequestOutput
    from dsv4ray.entrypoints.job_replica import output_row

    _, item = parse_line(json.dumps({"id": 1, "prompt": "ab", "logprobs": 1,
                                     "prompt_logprobs": 0}), 16)  # fmt: skip
    params = sampling_params(item["params"])
    assert (params.logprobs, params.prompt_logprobs) == (1, 0)
    out = RequestOutput("r", [5, 6], [7], "x", logprobs=[{7: -0.5, 8: -1.0}],
                        finish_reason="length", prompt_logprobs=[None, [[6, -2.0, 3]]])  # fmt: skip
    row = output_row("1", out)
    assert row["logprobs"] == [[[7, -0.5], [8, -1.0]]]
    assert row["prompt_logprobs"] == [None, [[6, -2.0, 3]]]
    plain = RequestOutput("r", [5], [7], "x", finish_reason="stop")
    assert "logprobs" not in output_row("1", plain)


def test_rows_keep_input_order_line_numbers_and_kinds(tmp_path):
    src = tmp_path / "in.jsonl"
    lines = [
        json.dumps({"id": "a", "prompt": "x"}),
        "",
        "{broken",
        json.dumps({"id": "b", "prompt": "y", "max_tokens": 3}),
        json.dumps({"id": "c", "prompt": "z"}),
        json.dumps({"id": "a", "prompt": "again"}),
        json.dumps({"id": 7, "prompt": "w", "bogus": 1}),
    ]
    src.write_text("\n".join(lines) + "\n")
    prior = {"b": True, "c": False}  # b finished, c's last line aborted
    rows = list(job_rows(str(src), prior, 16))
    assert [(r["line"], r["id"], r["kind"]) for r in rows] == [
        (1, "a", "new"), (3, "", "bad"), (4, "b", "done"), (5, "c", "retry"), (6, "", "bad"),
        (7, "", "bad"),
    ]  # fmt: skip
    assert "not JSON" in rows[1]["problem"] and "duplicate id 'a'" in rows[4]["problem"]
    assert "unknown field 'bogus'" in rows[5]["problem"]
    assert json.loads(rows[0]["request"]) == {"prompt": "x", "params": {"max_tokens": 16}}
    assert rows[2]["request"] == ""  # a finished line carries nothing to run
    assert scan_input(str(src), prior, 16) == (6, True)
    finished = dict.fromkeys(["a", "b", "c"], True)  # and line 7 is bad (bogus), not new
    assert scan_input(str(src), finished, 16) == (6, False)  # none to run


def test_a_line_that_is_not_utf8_is_a_bad_line_and_the_others_run(tmp_path):
    src = tmp_path / "in.jsonl"
    good = [json.dumps({"id": i, "prompt": "x"}).encode() for i in ("a", "c")]
    src.write_bytes(good[0] + b'\n{"id": "b\xff", "prompt": "y"}\n' + good[1] + b"\n")
    rows = list(job_rows(str(src), {}, 16))
    assert [(r["line"], r["id"], r["kind"]) for r in rows] == [
        (1, "a", "new"), (2, "", "bad"), (3, "c", "new"),
    ]  # fmt: skip
    assert rows[1]["problem"] == "not UTF-8 text (byte 0xff at column 10)"
    assert scan_input(str(src), {}, 16) == (3, True)


def test_an_output_that_is_the_input_is_refused_through_a_file_uri(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": 1, "prompt": "Hi"}) + "\n")
    problem = usage_problem(str(tmp_path), f"file://{src}", str(src), joined=True)
    assert problem == f"--output {str(src)!r} is the input file (results would be appended to it)"


def test_the_read_task_sends_chunks_of_rows_in_input_order(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": "p"}) + "\n" for i in range(10)))
    (task,) = JobLines(str(src), {}, 16, rows_per_chunk=4).get_read_tasks(8)
    chunks = [json.loads(row["rows"]) for block in task() for row in block.to_pylist()]
    assert [len(c) for c in chunks] == [4, 4, 2]  # one Ray Data row per chunk
    assert [r["line"] for c in chunks for r in c] == list(range(1, 11))
    assert [r["id"] for c in chunks for r in c] == [str(i) for i in range(10)]


def test_ttft_percentiles_come_from_a_bounded_histogram():
    rng = random.Random(0)
    values = [rng.lognormvariate(-3, 1) for _ in range(5000)]
    stats = JobStats()
    for v in values:
        stats.add_ttft(v)
    assert len(stats.ttft_buckets) < 1000  # whatever the number of requests
    ordered = sorted(values)
    for p in (0.5, 0.99):
        exact = ordered[int(p * len(ordered))]
        assert abs(stats.ttft_percentile(p) / exact - 1) < 0.012, p
    assert math.isnan(JobStats().ttft_percentile(0.5))


def test_a_job_whose_lines_all_finished_or_are_bad_starts_no_engine(tmp_path, monkeypatch, capsys):
    from dsv4ray.entrypoints import job

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bad = [{"id": "b", "prompt": "y", "max_tokens": 0}, {"id": "a", "prompt": "again"},
           {"id": "c", "prompt": "z", "temperature": -1}]  # fmt: skip
    src.write_text("\n".join([json.dumps({"id": "a", "prompt": "x"}), "{broken",
                              *map(json.dumps, bad)]) + "\n")  # fmt: skip
    row = {"id": "a", "text": "x", "token_ids": [1], "finish_reason": "length", "metrics": {}}
    dst.write_text(json.dumps(row) + "\n")

    def no_ray(*args):
        raise AssertionError("a job with nothing to run started Ray")

    monkeypatch.setattr(job, "ensure_ray", no_ray)
    ckpt = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "stdlib-tiny")
    assert job.run_job(ckpt, str(src), str(dst)) == 1  # the bad lines
    err = capsys.readouterr().err
    assert "line 2: not JSON" in err and "line 4: duplicate id 'a'" in err
    assert "0 requests (0 failed, 4 bad lines, 1 already done, 0 retried)" in err, err
    assert dst.read_text() == json.dumps(row) + "\n"  # nothing appended


@pytest.mark.parametrize(
    "replicas,pp,cores,expected",
    [
        (1, 1, 2, 2),  # 0.25 + 1 x (0.5 + 0.5) fits in the cores
        (2, 1, 2, 3),  # 0.25 + 2 x (0.5 + 0.5) = 2.25: two replicas would wait for ever on 2
        (2, 2, 2, 4),  # 0.25 + 2 x (0.5 + 2 x 0.5) = 3.25
        (2, 1, 16, 16),  # a bigger machine keeps its cores
    ],
)
def test_a_local_ray_has_the_cpus_its_job_asks_for(replicas, pp, cores, expected, monkeypatch,
                                                   capsys):  # fmt: skip
    from dsv4ray.engine.config import EngineConfig
    from dsv4ray.entrypoints import job

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    config = EngineConfig.build("unused", check_model=False, use_ray=True, pp_size=pp)
    options = job.JobOptions(replicas=replicas)
    assert job._local_cpus(options, config, "cpu") == expected
    job._say_shared_cores(options, config, "cpu", expected)  # said once the local Ray started
    said = capsys.readouterr().err
    assert (f"the local Ray gets {expected} on this {cores}-core machine" in said) == (
        expected > cores
    )


@pytest.mark.parametrize(
    "nodes,device,autoscaler,problem",
    [
        ([{"CPU": 2.0}], "cpu", False, "they need {'CPU': 2.25} in all and the cluster has"),
        ([{"CPU": 4.0}], "cpu", False, None),
        ([{"CPU": 2.0}], "cpu", True, None),  # an autoscaler may add a node: the job waits
        ([{"CPU": 16.0, "GPU": 1.0}], "cuda", False, "they need {'GPU': 2.0} in all"),
        ([{"CPU": 16.0}], "cuda", False, "no node has {'GPU': 1"),  # not even one replica
    ],
)
def test_a_job_larger_than_its_cluster_is_refused_by_what_it_lacks(
    nodes, device, autoscaler, problem, monkeypatch
):
    from dsv4ray.engine.config import EngineConfig
    from dsv4ray.entrypoints import job

    monkeypatch.setattr(job.ray, "nodes", lambda: [{"Alive": True, "Resources": n} for n in nodes])
    monkeypatch.setattr(job, "declared_node_types", lambda: {"gpu": {}} if autoscaler else {})
    config = EngineConfig.build("unused", check_model=False, use_ray=True)
    got = job._shortfall(job.JobOptions(replicas=2), config, device)
    if problem is None:
        assert got is None
    elif "no node has" in problem:
        assert problem in got and "check --accelerator" in got and "fewer" not in got, got
    else:
        assert problem in got and "2 replicas" in got and "use fewer --replicas" in got, got


def test_stages_that_share_a_gpu_fit_a_one_gpu_cluster(monkeypatch):
    """pp 2 at half a GPU a stage asks for one GPU in all: a one-GPU node holds the job."""
    from dsv4ray.engine.config import EngineConfig
    from dsv4ray.entrypoints import job

    node = {"CPU": 16.0, "GPU": 1.0}
    monkeypatch.setattr(job.ray, "nodes", lambda: [{"Alive": True, "Resources": node}])
    monkeypatch.setattr(job, "declared_node_types", lambda: {})
    shared = EngineConfig.build("unused", check_model=False, use_ray=True, pp_size=2,
                                num_gpus_per_stage=0.5)  # fmt: skip
    assert job._shortfall(job.JobOptions(replicas=1), shared, "cuda") is None
    whole = EngineConfig.build("unused", check_model=False, use_ray=True, pp_size=2)
    assert "they need {'GPU': 2.0} in all" in job._shortfall(job.JobOptions(1), whole, "cuda")


@pytest.mark.parametrize(
    "messages,problem",
    [
        ([{"role": "user", "content": "hi", "nmae": "x"}], "messages.0.nmae"),
        ([{"role": "wizard", "content": "hi"}], "messages.0.role"),
        ([{"role": "user", "content": "hi", "name": "bob"}], "messages.0.name"),  # not dropped
        ([{"role": "user"}], "messages.0.content"),
        ([{"role": "user", "content": "hi"},
          {"role": "tool", "tool_call_id": "c9", "content": "x"}], "messages.1.tool_call_id"),
        ([], "non-empty"),
    ],
)  # fmt: skip
def test_a_lines_messages_are_checked_as_the_chat_api_checks_them(messages, problem):
    with pytest.raises(ValueError, match=f"^'messages': .*{problem}"):
        parse_line(json.dumps({"id": 1, "messages": messages}), 16)


def test_a_lines_text_parts_are_joined_for_the_chat_format():
    # as paragraphs, as the DeepSeek-V4 format joins a message's parts
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    _, item = parse_line(json.dumps({"id": 1, "messages": [{"role": "user", "content": parts}]}), 4)
    assert item["messages"] == [{"role": "user", "content": "Hel\n\nlo"}]


def test_input_uris_that_cannot_be_opened_and_odd_lines_are_named(tmp_path):
    model = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "stdlib-tiny")
    out = str(tmp_path / "out.jsonl")
    for uri in ("foo://bar/in.jsonl", "file://relative.jsonl"):
        assert usage_problem(model, uri, out, False).startswith(f"cannot open the input {uri!r}")
    both = {"id": 1, "prompt": "p", "structured_output": {"regex": "a+"},
            "response_format": {"type": "text"}}  # fmt: skip
    with pytest.raises(ValueError, match="at most one of 'structured_output' and"):
        parse_line(json.dumps(both), 4)
    assert parse_line("\ufeff" + json.dumps({"id": 1, "prompt": "p"}), 4)[0] == "1"  # a BOM
    dst = tmp_path / "prior.jsonl"
    dst.write_bytes(b'{"id": "a", "finish_reason": "stop"}\n\xff\xfe garbage\n')
    assert last_results(str(dst)) == {"a": True}  # a line edited into bad UTF-8 is no result


def test_a_signal_while_the_job_shuts_down_is_noted_not_cutting_it_short():
    import signal

    from dsv4ray.entrypoints import job

    stats = JobStats(lines=5)
    before = signal.getsignal(signal.SIGTERM)
    with job._signals_noted(stats, before):
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt inside
        os.kill(os.getpid(), signal.SIGTERM)  # and no exit
    assert stats.interrupted and stats.terminated and stats.left == 5
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigterm_while_ray_starts_ends_the_job_as_stopped(tmp_path, monkeypatch, capsys):
    import signal

    from dsv4ray.entrypoints import job

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n")

    def ray_init_cut_short(*args):  # what ray.init's own SIGTERM handler raises
        raise SystemExit(signal.SIGTERM)

    monkeypatch.setattr(job, "ensure_ray", ray_init_cut_short)
    monkeypatch.setattr(job, "stop_local_ray", lambda: None)  # no Ray came up
    ckpt = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "stdlib-tiny")
    assert job.run_job(ckpt, str(src), str(dst)) == job.EXIT_TERMINATED
    assert "dsv4ray job: stopped by SIGTERM, 1 input lines not reached" in capsys.readouterr().err


def test_outputs_that_cannot_be_appended_to_are_usage_problems(tmp_path):
    """An empty name, a folder's name (with or without its slash), a folder that does not
    exist and a file that cannot be opened are named before any work starts (exit 2), and the
    check leaves no file behind."""
    model = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "stdlib-tiny")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": 1, "prompt": "Hi"}) + "\n")
    for out in ("", str(tmp_path / "newdir") + "/", str(tmp_path), str(tmp_path / "no" / "o")):
        assert usage_problem(model, str(src), out, False).startswith("cannot write the output")
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    blocked.chmod(0o500)
    if not os.access(blocked, os.W_OK):  # root writes anyway: nothing to refuse there
        assert "cannot write" in usage_problem(model, str(src), str(blocked / "o"), False)
    out = tmp_path / "fresh.jsonl"
    assert usage_problem(model, str(src), str(out), False) is None and not out.exists()


def test_a_job_asked_to_run_without_ray_is_a_usage_error(tmp_path, capsys):
    # its replicas are Ray actors whatever the option says: refused rather than ignored
    from dsv4ray.entrypoints import job

    model = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "stdlib-tiny")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": 1, "prompt": "Hi"}) + "\n")
    assert job.run_job(model, str(src), str(tmp_path / "o.jsonl"), use_ray=False) == 2
    assert "use_ray=False" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_a_deeply_nested_line_or_a_lone_surrogate_prompt_is_a_bad_line(tmp_path):
    src = tmp_path / "in.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    src.write_text("\n".join([json.dumps({"id": "a", "prompt": "x"}), deep,
                              '{"id": "b", "prompt": "\\ud800"}']) + "\n")  # fmt: skip
    rows = list(job_rows(str(src), {}, 16))
    assert [(r["id"], r["kind"]) for r in rows] == [("a", "new"), ("", "bad"), ("", "bad")]
    assert rows[1]["problem"] == "JSON nested too deeply"
    assert rows[2]["problem"].startswith("'prompt' is not valid text")
    assert scan_input(str(src), {}, 16) == (3, True)


def test_a_null_max_tokens_takes_the_jobs_default():
    _, item = parse_line(json.dumps({"id": 1, "prompt": "hi", "max_tokens": None}), 7)
    assert item["params"]["max_tokens"] == 7


def test_a_summary_without_timed_requests_prints_no_nan(capsys):
    from dsv4ray.entrypoints.job import _summary

    _summary(JobStats(), 1.0)  # an empty input, or every line already done
    err = capsys.readouterr().err
    assert "nan" not in err and "no first token timed" in err
