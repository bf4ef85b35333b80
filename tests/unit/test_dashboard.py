"""The Grafana dashboard asks only for metrics that memops exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from memops.controllers import metrics

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "memops-dashboard.json"
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in metrics.NAMES:
            return name[: -len(suffix)]
    return name


def test_every_expression_names_a_metric_that_exists() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    named = {family(m) for q in queries for m in re.findall(r"\bmemops_[a-z_]+", q)}
    assert named, "the dashboard names no memops metric"
    assert named <= metrics.NAMES, f"unknown metrics: {sorted(named - metrics.NAMES)}"
    # Every exported family is shown somewhere.
    assert metrics.NAMES <= named, f"not on the dashboard: {sorted(metrics.NAMES - named)}"


def test_metric_names_follow_the_naming_guide() -> None:
    for name in metrics.NAMES:
        assert name.startswith("memops_") and name == name.lower()
        assert not name.endswith("_total"), "counters are declared without _total; the client adds it"
