"""Malformed HTTP requests in families, for bench/http_fuzz.py and tests/ray/test_serve_fuzz.py.

Every case is one request and what must come back: a malformed one a 4xx with OpenAI's error
body (and, where the field is known, ``param`` naming it); a valid one (``valid``), however
extreme its values, a 200. Bodies are bytes built by hand where JSON itself is the attack (lone
surrogate escapes, NaN, 5,000-digit integers, 100,000 brackets). ``families(...)`` yields them
reproducibly from a seed; sizes scale with ``scale``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HOLE = '"__FUZZ__"'  # where a raw JSON literal goes into an encoded body
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass(frozen=True)
class Case:
    family: str
    path: str
    body: bytes | None
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = ()
    param: str | None = None  # the error's param when the field is known; None: not checked
    valid: bool = False  # a valid request, however extreme: must be answered 200


@dataclass(frozen=True)
class Target:
    model: str  # the served model name
    context: int  # max_model_len: a longer prompt is a 400
    api_key: str | None  # with a key: the key family; without: the Host/Origin family


def completion(target: Target, **fields) -> dict:
    return {"model": target.model, "prompt": "Hello", "max_tokens": 1, **fields}


def chat(target: Target, **fields) -> dict:
    messages = [{"role": "user", "content": "Hello"}]
    return {"model": target.model, "messages": messages, "max_tokens": 1, **fields}


def with_raw(body: dict, path: str, raw: str) -> bytes:
    """``body`` as JSON with the raw literal ``raw`` at ``path`` (dots; digits index lists)."""
    data = json.loads(json.dumps(body))
    *parents, last = path.split(".")
    node = data
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    node[int(last) if isinstance(node, list) else last] = "__FUZZ__"
    return json.dumps(data).replace(HOLE, raw, 1).encode()


def deep_nesting(target: Target, rng: random.Random, scale: int) -> Iterator[Case]:
    depths = [65, 66, 100, 1000, 4300, 100_000][: 2 + 4 * scale]
    for path, field in [(COMPLETIONS, "prompt"), (COMPLETIONS, "stop"), (CHAT, "messages")]:
        for depth in depths:
            for opener, closer in (("[", "]"), ('{"a":', "}")):
                for tail in (closer * depth, ""):  # balanced, and cut off
                    raw = opener * depth + "1" + tail
                    base = completion(target) if path == COMPLETIONS else chat(target)
                    yield Case("deep nesting", path, with_raw(base, field, raw))
    yield Case("deep nesting", COMPLETIONS, b'{"a":' * 5000)
    yield Case("deep nesting", CHAT, b"[" * 100_000)


INT_FIELDS = {
    COMPLETIONS: ["max_tokens", "seed", "top_k", "logprobs", "n", "best_of", "prompt.0",
                  "stop_token_ids.0"],
    CHAT: ["max_tokens", "max_completion_tokens", "top_logprobs", "seed", "n"],
}  # fmt: skip


def long_integers(target: Target, rng: random.Random, scale: int) -> Iterator[Case]:
    digits = [41, 64, 4300, 4301, 10_000, 100_000][: 2 + 4 * scale]
    for path, fields in INT_FIELDS.items():
        for field in fields:
            base = completion(target, prompt=[1, 2], stop_token_ids=[3])
            base = base if path == COMPLETIONS else chat(target, logprobs=True)
            for num_digits in digits:
                for sign in ("", "-"):
                    raw = sign + str(rng.randint(1, 9)) + "7" * (num_digits - 1)
                    yield Case("long integers", path, with_raw(base, field, raw), param=field)


FLOAT_FIELDS = {
    COMPLETIONS: ["temperature", "top_p", "max_tokens", "seed", "top_k", "frequency_penalty",
                  "presence_penalty", "logprobs", "n", "prompt.1", "stop_token_ids.0",
                  "logit_bias.5"],
    CHAT: ["temperature", "top_p", "max_completion_tokens", "top_logprobs"],
}  # fmt: skip
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1E400", "-0.5e99999"]


def non_finite(target: Target, rng: random.Random, scale: int) -> Iterator[Case]:
    for path, fields in FLOAT_FIELDS.items():
        for field in fields:
            base = completion(target, prompt=[1, 2], stop_token_ids=[3], logit_bias={"5": 1})
            base = base if path == COMPLETIONS else chat(target, logprobs=True)
            for literal in NON_FINITE[: 3 + 4 * scale]:
                yield Case("NaN/Infinity", path, with_raw(base, field, literal), param=field)


STRING_FIELDS = {
    COMPLETIONS: ["model", "prompt", "prompt.0", "stop", "stop.1", "user", "suffix",
                  "an_unknown_field", "stream_options.x"],
    CHAT: ["model", "messages.0.content", "messages.0.content.0.text", "messages.0.name",
           "messages.0.role", "messages.0.content.0.type", "user", "stop.0"],
}  # fmt: skip
SURROGATES = [r"\ud800", r"\udfff", r"a\udbff", r"\ud800\ud800", r"\udc00\ud800", r"\ud83dx"]


def _string_base(target: Target, path: str, field: str) -> dict:
    if path == COMPLETIONS:
        prompt = ["Hi"] if field == "prompt.0" else "Hi"
        return completion(target, prompt=prompt, stop=["a", "b"])
    content = [{"type": "text", "text": "Hi"}] if "content.0" in field else "Hi"
    return chat(target, messages=[{"role": "user", "content": content}], stop=["a"])


def lone_surrogates(target: Target, rng: random.Random, scale: int) -> Iterator[Case]:
    for path, fields in STRING_FIELDS.items():
        for field in fields:
            base = _string_base(target, path, field)
            for surrogate in SURROGATES[: 2 + 4 * scale]:
                body = with_raw(base, field, f'"{surrogate}"')
                yield Case("lone surrogates", path, body, param=field)
    for surrogate in SURROGATES[: 2 + 4 * scale]:  # in a key: its parent is named
        key = f'{{"{surrogate}": 1}}'
        body = with_raw(chat(target), "messages.0", key)
        yield Case("lone surrogates", CHAT, body, param="messages.0")
        body = with_raw(completion(target), "stream_options", key)
        yield Case("lone surrogates", COMPLETIONS, body, param="stream_options")


INT_WRONG = [True, False, 1.5, "5", [], {}, [1], "", 1000.0]
FLOAT_WRONG = [True, "0.5", [], {}, [0.5], ""]
BOOL_WRONG = [1, 0, "true", None, [], {}, 1.0]
STR_WRONG = [1, True, [], {}, ["a"], 1.5]
WRONG_TYPES = {
    **dict.fromkeys(["max_tokens", "seed", "top_k", "n", "best_of", "logprobs"], INT_WRONG),
    **dict.fromkeys(["temperature", "top_p", "frequency_penalty", "presence_penalty"], FLOAT_WRONG),
    **dict.fromkeys(["stream", "echo", "ignore_eos", "return_token_ids"], BOOL_WRONG),
    "model": [*STR_WRONG, None],
    "user": STR_WRONG,
    "suffix": STR_WRONG,
    "prompt": [5, True, None, {}, [], [True], [1.5], ["a", "b"], [[1], [2]], [[]], [{"a": 1}]],
    "stop": [5, True, [], ["a"] * 5, [""], "", [1], {}, [None], [["a"]]],
    "logit_bias": ["x", [], {"1": "a"}, {"1": 5}, 5],
    "stop_token_ids": ["x", [1.5], [True], [-1], {}, 5, [[1]], ["1"]],
}
CHAT_WRONG_TYPES = {
    "messages": ["x", {}, [1], [{}], [[]], None, [], [{"role": "user", "content": 7}],
                 [{"role": 5, "content": "x"}], [{"role": "wizard", "content": "x"}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                 [{"role": "user", "content": [{"type": "text"}]}],
                 [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                 [{"role": "user", "content": [5]}]],
    "logprobs": [1, "true", None, [], 2],
    "top_logprobs": [True, 1.5, "2", []],
    "max_completion_tokens": INT_WRONG,
    "stream_options": ["x", 1, [], {"include_usage": "yes"}],
}  # fmt: skip


def wrong_types(target: Target, rng: random.Random, scale: int) -> Iterator[Case]:
    for field, values in WRONG_TYPES.items():
        for value in values:
            body = completion(target, **{field: value})
            yield Case("wrong types", COMPLETIONS, json.dumps(body).encode(), param=field)
    for field, values in CHAT_WRONG_TYPES.items():
        for value in values:
            extra = {"stream": True} if field == "stream_options" else {"logprobs": True}
            body = chat(target, **{**extra, field: value})
            yield Case("wrong types", CHAT, json.dumps(body).encode(), param=field)


def out_of_range(target: Target, rng: random.Random, scale: int) -> Iterator[Case]:
    """Numbers of the right type outside what the field allows (SamplingParams' bounds, the
    context, int64 for what travels to the stages, unsupported values)."""
    big = [2**63, 2**64, -(2**63)]
    completions = {
        "max_tokens": [0, -1, target.context, 10**6, *big],
        "temperature": [-1e-38, -0.5, -5e-324, 2.0000001, 1e308],
        "top_p": [0, 0.0, -5e-324, 1.0000001, 1e308, -1],
        "top_k": [0, -2, *big],
        "seed": big,
        "logprobs": [-1, 21, 2**63],
        "n": [0, -1, 65],
        "best_of": [0, 65],
        "prompt_logprobs": [-1, 21],
        "frequency_penalty": [2.0000001, -2.5, 1e308],
        "presence_penalty": [3.0, -5e3],
        "repetition_penalty": [0, -1.0, 0.0],
        "min_p": [-0.1, 1.5],
        "min_tokens": [-1, 10**6],
        "logit_bias": [{"x": 1.0}, {"5": 100.5}, {"-3": 1.0}, {str(2**64): 1.0}],
        "prompt": [[-1], [10**6], [2**63], [2**64], [5] * (target.context + 1)],
        "stop_token_ids": [[-1], [2**63], [2**63 - 1], list(range(1025))],  # ids past the vocab
        "suffix": ["x"],
    }
    for field, values in completions.items():
        for value in values:
            body = json.dumps(completion(target, **{field: value})).encode()
            yield Case("out of range", COMPLETIONS, body, param=field)
    long_content = [{"role": "user", "content": "x" * (target.context + 5)}]
    chats = {
        "top_logprobs": [21, -1, 2**63],
        "max_completion_tokens": [0, -1, target.context],
        "messages": [long_content],
    }
    for field, values in chats.items():
        for value in values:
            body = chat(target, logprobs=True, **{field: value})
            if field == "max_completion_tokens":  # max_tokens would win over it
                del body["max_tokens"]
            param = "max_tokens" if field == "max_completion_tokens" else field
            yield Case("out of range", CHAT, json.dumps(body).encode(), param=param)


VALID_EXTREMES = [
    {"temperature": 1e-38}, {"temperature": 5e-324}, {"temperature": 2.0}, {"temperature": 0},
    {"temperature": -0.0}, {"top_p": 5e-324}, {"top_p": 1e-300}, {"top_k": 1},
    {"top_k": 10**6}, {"top_k": 2**63 - 1}, {"seed": -(2**63 - 1)}, {"seed": 2**63 - 1},
    {"logprobs": 0}, {"logprobs": 20}, {"stop_token_ids": [0] * 1024}, {"stop": "a" * 1000},
    {"prompt": ""}, {"prompt": [0]}, {"temperature": 1e-38, "top_p": 5e-324, "top_k": 1},
    {"n": 3, "seed": 2**63 - 1}, {"n": 2, "best_of": 3}, {"echo": True, "logprobs": 20},
    {"prompt": ["a", [5, 6], ""], "n": 2}, {"prompt_logprobs": 20, "echo": True},
]  # fmt: skip


def valid_extremes(target: Target, rng: random.Random, scale: int) -> Iterator[Case]:
    """Valid requests with extreme values: the engine must answer them (greedy, top one)."""
    for fields in VALID_EXTREMES:
        body = completion(target, ignore_eos=True, **fields)
        yield Case("valid extremes", COMPLETIONS, json.dumps(body).encode(), valid=True)


def _full_bodies(target: Target) -> list[tuple[str, bytes]]:
    full_completion = completion(target, prompt=[1, 2, 3], stop=["x"], seed=3, temperature=0.5)
    full_chat = chat(target, temperature=0, logprobs=True, top_logprobs=2, user="u")
    return [(COMPLETIONS, json.dumps(full_completion).encode()),
            (CHAT, json.dumps(full_chat).encode())]  # fmt: skip


def truncated(target: Target, rng: random.Random, scale: int) -> Iterator[Case]:
    for path, body in _full_bodies(target):
        cuts = rng.sample(range(len(body)), min(len(body), 10 + 60 * scale))
        for cut in sorted(cuts):  # never the whole body: a cut object is never valid JSON
            yield Case("truncated bodies", path, body[:cut])


BAD_UTF8 = [b"\xff", b"\xfe", b"\xc0\x80", b"\xed\xa0\x80", b"\xf5\x80\x80\x80", b"\x80",
            b"\xe2\x82", b"\xf0\x9f\x98", b"\xef\xbf"]  # fmt: skip


def invalid_utf8(target: Target, rng: random.Random, scale: int) -> Iterator[Case]:
    for path, body in _full_bodies(target):
        anchors = [b'"model": "', b'"max_tokens": ', b'{"', b", ", b""]
        for bad in BAD_UTF8:
            for anchor in anchors[: 2 + 3 * scale]:
                at = body.index(anchor) + len(anchor) if anchor else 0
                yield Case("invalid UTF-8", path, body[:at] + bad + body[at:])
            yield Case("invalid UTF-8", path, body + bad)


NOT_JSON = [b"model=x&prompt=y", b"--b\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b--",
            b"<request><prompt>hi</prompt></request>", b"", b"null", b"true", b"123", b'"str"',
            b"[]", b"[{}]", b"\x00\x00", b"prompt: hi"]  # fmt: skip
CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=b", "application/xml", "",
                 "application/json; charset=utf-16"]  # fmt: skip


def content_types(target: Target, rng: random.Random, scale: int) -> Iterator[Case]:
    for path in (COMPLETIONS, CHAT):
        for body in NOT_JSON:
            for content_type in CONTENT_TYPES[: 2 + 4 * scale]:
                headers = (("content-type", content_type),) if content_type else ()
                yield Case("bad content types", path, body, headers=headers)


def huge_arrays(target: Target, rng: random.Random, scale: int) -> Iterator[Case]:
    """Arrays as large as the body limit allows (and larger: 413)."""
    num = 1 + 2 * scale
    messages = [{"role": "user", "content": "a"}] * 20_000
    parts = [{"type": "text", "text": "a"}] * 10_000
    cases = [
        (COMPLETIONS, {"prompt": [7] * 300_000}, None),  # beyond the 1 MiB body limit
        (COMPLETIONS, {"prompt": [7] * 100_000}, "prompt"),
        (COMPLETIONS, {"stop": ["s"] * 100_000}, "stop"),
        (COMPLETIONS, {"stop_token_ids": [9] * 100_000}, "stop_token_ids"),
        (COMPLETIONS, {"logit_bias": {str(i): 1 for i in range(40_000)}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "x" * (2 << 20)}, None),  # a 2 MiB string: 413
        (CHAT, {"messages": messages}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": parts}]}, "messages"),
    ]
    for path, fields, param in cases:
        build = completion if path == COMPLETIONS else chat
        body = json.dumps(build(target, **fields)).encode()
        for _ in range(num):
            yield Case("huge arrays", path, body, param=param)


def routes_and_methods(target: Target, rng: random.Random, scale: int) -> Iterator[Case]:
    """Unknown routes and wrong methods (HEAD is left out: its answers carry no body)."""
    for path in (COMPLETIONS, CHAT):
        for method in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS"):
            yield Case("routes and methods", path, None, method=method)
    for path in ("/v1/models", "/v1/dsv4ray/stats", "/health"):
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            yield Case("routes and methods", path, b"{}", method=method)
    unknown = ["/", "/v1", "/v2/completions", "/v1/completions/x", "/v1/models/nope",
               "/v1/models/%ff%fe", "/v1/%00", "/%2e%2e/etc/passwd", "/v1/" + "a" * 4000,
               "/v1/models/" + "%C0%AF" * 10, "/v1/engines/x/completions", "/v1/embeddings",
               "/V1/COMPLETIONS", "/v1//completions/"]  # fmt: skip
    for path in unknown:
        for method in ("GET", "POST")[: 1 + scale]:
            body = None if method == "GET" else json.dumps(completion(target)).encode()
            yield Case("routes and methods", path, body, method=method)


BAD_AUTHORIZATIONS = ["", "Bearer", "Bearer %20", "Basic dXNlcjpwYXNz", "Bearer nope", "Token {k}",
                      "Bearer {k}x", "Bearer x{k}", "Bearer " + "k" * 8000, "Bearer {k} {k}",
                      "{k}", "Bearer\t{k}", "Bearer {short}"]  # fmt: skip


def keys(target: Target, rng: random.Random, scale: int) -> Iterator[Case]:
    """A keyed server: missing and wrong keys are 401 on every route but /health."""
    key = target.api_key or ""
    routes = [(COMPLETIONS, "POST", completion(target)), (CHAT, "POST", chat(target)),
              ("/v1/models", "GET", None), ("/v1/dsv4ray/stats", "GET", None)]  # fmt: skip
    for auth in BAD_AUTHORIZATIONS:
        value = auth.format(k=key, short=key[:-1])
        headers = (("authorization", value),) if value else ()
        for path, method, body in routes:
            data = None if body is None else json.dumps(body).encode()
            yield Case("missing or bad keys", path, data, method=method, headers=headers)


FOREIGN_HOSTS = ["evil.example", "evil.example:8000", "localhost.evil.example", "10.1.2.3:8000",
                 "0.0.0.0:8000", "[::2]:8000", "127.0.0.1.nip.io", "localhost:x"]  # fmt: skip
FOREIGN_ORIGINS = ["null", "http://evil.example", "http://localhost.evil.example", "file://",
                   "https://127.0.0.1.nip.io"]  # fmt: skip


def hosts_and_origins(target: Target, rng: random.Random, scale: int) -> Iterator[Case]:
    """A keyless server: other hosts and origins are 403 on every route, /health included."""
    routes = [(COMPLETIONS, "POST", completion(target)), (CHAT, "POST", chat(target)),
              ("/v1/models", "GET", None), ("/health", "GET", None),
              ("/v1/dsv4ray/stats", "GET", None), ("/nothing", "GET", None)]  # fmt: skip
    headers = [(("host", h),) for h in FOREIGN_HOSTS]
    headers += [(("origin", o),) for o in FOREIGN_ORIGINS]
    for header in headers:
        for path, method, body in routes:
            data = None if body is None else json.dumps(body).encode()
            yield Case("foreign hosts and origins", path, data, method=method, headers=header)
    local = (("origin", "http://localhost:3000"),)
    yield Case("foreign hosts and origins", "/health", None, "GET", local, valid=True)


def _tool(name="f", **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


OBJECT = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
BAD_TOOLS = [
    ({"tools": "x"}, "tools"), ({"tools": [5]}, "tools.0"), ({"tools": [{}]}, "tools.0"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [_tool("a b")]}, "tools.0.function.name"),
    ({"tools": [_tool("x" * 65)]}, "tools.0.function.name"),
    ({"tools": [_tool(description=5)]}, "tools.0.function.description"),
    ({"tools": [_tool(parameters={"type": "array"})]}, "tools.0.function.parameters"),
    ({"tools": [_tool(parameters={"type": 5})]}, "tools.0.function.parameters"),
    ({"tools": [_tool(strict="yes")]}, "tools.0.function.strict"),
    ({"tools": [_tool(extra=1)]}, "tools.0.function.extra"),
    ({"tools": [_tool(), _tool()]}, "tools"),
    ({"tools": [_tool()], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [_tool()], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": [_tool()], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
]  # fmt: skip


def tool_requests(target: Target, rng: random.Random, scale: int) -> Iterator[Case]:
    """Malformed tools, choices and tool messages (400 naming the field); valid tool requests
    (their prompt fits a context of 2048 tokens)."""
    for fields, param in BAD_TOOLS:
        yield Case("tool requests", CHAT, json.dumps(chat(target, **fields)).encode(), param=param)
    valid = [{"tools": [_tool()], "tool_choice": "none"}]
    if target.context >= 2048:
        valid += [{"tools": [_tool(parameters=OBJECT)]},
                  {"tools": [_tool(parameters=OBJECT)], "tool_choice": "required"},
                  {"tools": [_tool()], "tool_choice": {"type": "function",
                                                      "function": {"name": "f"}}}]  # fmt: skip
    for fields in valid:
        body = chat(target, **fields, max_tokens=8)
        yield Case("tool requests", CHAT, json.dumps(body).encode(), valid=True)


FAMILIES = [deep_nesting, long_integers, non_finite, lone_surrogates, wrong_types, out_of_range,
            truncated, invalid_utf8, content_types, huge_arrays, routes_and_methods,
            tool_requests]  # fmt: skip


def families(target: Target, seed: int = 0, scale: int = 1) -> list[Case]:
    """Every family's cases (scale 0: a small sample of each, for the test suite), then the
    key or the Host/Origin family as the target has a key or not, then the valid extremes."""
    rng = random.Random(seed)
    cases = [case for family in FAMILIES for case in family(target, rng, scale)]
    access = keys if target.api_key else hosts_and_origins
    return cases + list(access(target, rng, scale)) + list(valid_extremes(target, rng, scale))


def check_response(case: Case, status: int, content: bytes) -> str | None:
    """None when the answer is right, else what is wrong: "5xx", "status" (a malformed request
    not answered 4xx, or a valid one not 200), "body" (no OpenAI error body) or "param"."""
    if status >= 500:
        return "5xx"
    if case.valid or not 400 <= status < 500:
        return None if case.valid and status == 200 else "status"
    try:
        error = json.loads(content)["error"]
        well_formed = set(error) == ERROR_KEYS and isinstance(error["type"], str)
        well_formed = well_formed and isinstance(error["message"], str) and error["message"]
    except (ValueError, KeyError, TypeError):
        well_formed = False
    if not well_formed:
        return "body"
    return "param" if case.param is not None and error["param"] != case.param else None
