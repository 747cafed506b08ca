"""deploy/grafana-dashboard.json is built on the metrics a replica exports, and shows each."""

import json
import re
from pathlib import Path

from dsv4ray.entrypoints.openai.metrics import METRICS

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"


def test_the_dashboard_queries_only_exported_series_and_every_one_of_them():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {
        re.sub(r"_(bucket|sum|count)$", "", name)
        for expr in exprs
        for name in re.findall(r"ray_dsv4ray_\w+", expr)
    }
    assert used == {m.series for m in METRICS}
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
