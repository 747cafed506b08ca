"""bench/chaos.py's verdicts: its request records and fault times turned into result rows.

An abort is allowed when its request was unfinished at a stage kill, or was submitted after the
kill but before the engine served again (the engine aborts every unfinished request when it
notices the dead stage, and the requests waiting on a rebuild that fails): the first request
started after the kill that finishes marks the recovery. Any other abort is a bystander's.
"""

from __future__ import annotations

import json
from collections import Counter

from dsv4ray.bench.report import result

BYSTANDER = "aborted with no stage kill while it ran or waited"
WRONG = "finished greedy requests whose tokens differ from the reference's greedy ones"


def _detections(chaos) -> list[tuple[float, float]]:
    """(kill time, time the engine served again) per stage kill."""
    windows = []
    for t_kill in chaos.stage_kills:
        served = [r.end for r in chaos.records if r.outcome == "done" and r.start >= t_kill]
        windows.append((t_kill, min(served, default=float("inf"))))
    return windows


def _allowed(rec, windows) -> bool:
    return any(t_kill <= rec.end and rec.start <= t_seen for t_kill, t_seen in windows)


def _overlaps(rec, others) -> bool:
    return any(o.start <= rec.end and rec.start <= o.end for o in others)


def classify(chaos) -> dict:
    records = chaos.records
    greedy = [r for r in records if r.kind == "greedy"]
    poison = [r for r in records if r.kind.startswith("poison:")]
    windows = _detections(chaos)
    aborts = [r for r in greedy if r.outcome == "abort"]
    bystanders = [r for r in aborts if not _allowed(r, windows)]
    admitted = [p for p in poison if p.outcome != "refused"]
    done = [r for r in greedy if r.outcome == "done"]
    served = [p for p in poison if p.outcome == "done"]
    return {
        "greedy": greedy,
        "poison": poison,
        "done": done,
        "allowed": [r for r in aborts if _allowed(r, windows)],
        "bystanders": bystanders,
        "poison_bystanders": [r for r in bystanders if _overlaps(r, admitted)],
        "wrong": [r for r in done if r.tokens != chaos.refs[r.prompt][: r.max_tokens]],
        "hangs": [r for r in records if r.outcome == "hang"],
        "errors": [r for r in records if r.outcome == "error"],
        "refused": [p for p in poison if p.outcome == "refused"],
        "served": served,
        "not_greedy": [p for p in served if p.tokens != chaos.refs[p.prompt][: p.max_tokens]],
        "poison_aborted": [p for p in poison if p.outcome == "abort"],
    }


def _bad(name: str, value: int, unit: str, ceiling: int, note: str = "") -> dict:
    """A count of bad events out of ceiling chances: the target is zero."""
    return result(name, value, unit, ceiling, 0.0, "<=", note)


def _info(name: str, value: int, unit: str, ceiling: int, note: str = "") -> dict:
    return result(name, value, unit, ceiling, None, ">=", note)


def _request_rows(chaos, c: dict) -> list[dict]:
    n_greedy, n_all = len(c["greedy"]), len(chaos.records)
    errors = "; ".join(sorted({r.error for r in c["errors"]}))[:300]
    return [
        _info("greedy requests completed", len(c["done"]), "requests", n_greedy),
        _info("allowed aborts (running at a stage kill)", len(c["allowed"]), "requests", n_greedy),
        _bad("bystander aborts", len(c["bystanders"]), "requests", n_greedy, BYSTANDER),
        _bad(
            "bystander aborts next to a poison request",
            len(c["poison_bystanders"]),
            "requests",
            n_greedy,
        ),
        _bad("wrong tokens", len(c["wrong"]), "requests", len(c["done"]), WRONG),
        _bad(
            "hangs",
            len(c["hangs"]),
            "requests",
            n_all,
            f"not finished within {chaos.args.request_timeout:.0f} s",
        ),
        _bad("request errors", len(c["errors"]), "requests", n_all, errors),
    ]


def _fault_rows(chaos, c: dict) -> list[dict]:
    kills, hosts, sent = len(chaos.stage_kills), len(chaos.host_kills), chaos.poison_sent
    tally = Counter(f"{p.kind[7:]}: {p.outcome}" for p in c["poison"])
    outcomes = ", ".join(f"{what} x{n}" for what, n in sorted(tally.items()))
    served = f"{len(c['served'])} served, {len(c['poison_aborted'])} aborted; {outcomes}"
    load = f"{chaos.load_s:.0f} s of load, {chaos.args.clients} clients"
    faults = f"{kills} stage kills, {hosts} host-tier kills, {sent} poison requests; {load}"
    return [
        result(
            "faults injected", kills + hosts + sent, "faults", chaos.args.faults, 1.0, ">=", faults
        ),
        _info(
            "poison requests refused at submission",
            len(c["refused"]),
            "requests",
            sent,
            "ValueError before the first token: handled correctly",
        ),
        _bad(
            "poison requests served with non-greedy tokens",
            len(c["not_greedy"]),
            "requests",
            len(c["served"]),
            served[:300],
        ),
    ]


def _leak_rows(state: dict, leaked: set, live_files: int) -> list[dict]:
    pages = state["num_pages"] - state["num_free_pages"] - state["num_cached_pages"]
    return [
        _bad(
            "leaked device pages",
            pages,
            "pages",
            state["num_pages"],
            f"after the load drained; check_integrity: {state['integrity']}",
        ),
        _bad(
            "leaked /dev/shm files",
            len(leaked),
            "files",
            live_files,
            "after shutdown; ceiling: files the engine held while serving",
        ),
    ]


def summarize(chaos, state: dict, leaked: set, live_files: int) -> tuple[list[dict], str]:
    """(result rows, a plain-text summary)."""
    c = classify(chaos)
    rows = [
        *_fault_rows(chaos, c),
        *_request_rows(chaos, c),
        *_leak_rows(state, leaked, live_files),
    ]
    lines = ["chaos results:"]
    for row in rows:
        target = "" if row["target"] is None else f"  (target {row['op']} {row['target']})"
        lines.append(f"  {row['name']}: {row['value']} / {row['ceiling']} {row['unit']}{target}")
        if row["note"]:
            lines.append(f"      {row['note']}")
    return rows, "\n".join(lines)


def write_records(chaos, path: str) -> None:
    """Every fault and request as a JSON line, times in seconds since the load started."""
    t0 = chaos.t_start
    with open(path, "w") as f:
        for kind, times in (
            ("kill_stage", chaos.stage_kills),
            ("kill_host_tier", chaos.host_kills),
        ):
            for t in times:
                f.write(json.dumps({"fault": kind, "t": round(t - t0, 3)}) + "\n")
        for r in chaos.records:
            row = {
                "kind": r.kind,
                "start": round(r.start - t0, 3),
                "end": round(r.end - t0, 3),
                "outcome": r.outcome,
                "num_tokens": len(r.tokens),
                "max_tokens": r.max_tokens,
                "tokens": r.tokens,
                "reference": chaos.refs[r.prompt][: r.max_tokens],
                "error": r.error,
            }
            f.write(json.dumps(row) + "\n")
