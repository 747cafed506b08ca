"""worker/pd/bind_only.c preloaded into a fresh Python: wildcard TCP binds land on the chosen
address only inside ``narrowed``; every other bind is left as asked."""

import json
import os
import subprocess
import sys

from dsv4ray.worker.pd.bind_only import library, preload_env

PROBE = r"""
import json, socket
from dsv4ray.worker.pd.bind_only import narrowed

def bound(family, kind=socket.SOCK_STREAM, v6only=None):
    s = socket.socket(family, kind)
    if v6only is not None:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
    s.bind(("0.0.0.0" if family == socket.AF_INET else "::", 0))
    return s.getsockname()[0]

with narrowed("127.0.0.1") as on:
    inside = [on, bound(socket.AF_INET), bound(socket.AF_INET6),
              bound(socket.AF_INET6, v6only=1), bound(socket.AF_INET, socket.SOCK_DGRAM)]
outside = [bound(socket.AF_INET), bound(socket.AF_INET6)]
with narrowed("not-an-address") as on:
    refused = [on, bound(socket.AF_INET)]
print(json.dumps([inside, outside, refused]))
"""


def _probe(env: dict[str, str]) -> list:
    done = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_wildcard_tcp_binds_land_on_the_address_only_while_narrowed():
    path = library()
    assert path is not None, "this machine cannot build worker/pd/bind_only.c (no C compiler?)"
    preload = {k: v.replace("${LD_PRELOAD}", "") for k, v in preload_env(path).items()}
    inside, outside, refused = _probe(preload)
    # TCP over IPv4 and dual-stack IPv6 narrowed; a v6-only socket and UDP bound as asked
    assert inside == [True, "127.0.0.1", "::ffff:127.0.0.1", "::", "0.0.0.0"]
    assert outside == ["0.0.0.0", "::"]
    assert refused == [False, "0.0.0.0"]


def test_without_the_preload_narrowed_says_so_and_changes_nothing():
    inside, outside, _ = _probe({"LD_PRELOAD": ""})
    assert inside == [False, "0.0.0.0", "::", "::", "0.0.0.0"]
    assert outside == ["0.0.0.0", "::"]


def test_the_library_is_built_once_per_source(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = library()
    assert first is not None, "no C compiler on this machine"
    built = os.stat(first).st_mtime_ns
    assert library() == first and os.stat(first).st_mtime_ns == built
    assert [p.name for p in (tmp_path / "dsv4ray").iterdir()] == [os.path.basename(first)]


def test_a_cache_that_cannot_be_written_leaves_the_filters_with_a_warning(tmp_path, monkeypatch,
                                                                         caplog):  # fmt: skip
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    with caplog.at_level("WARNING", logger="dsv4ray.transfer"):
        assert library() is None
    assert "behind socket filters" in caplog.text and "not-a-directory" in caplog.text
