"""dashboards/: the Grafana dashboard's queries name only metrics the monitor exposes, with their types."""

from __future__ import annotations

import json
import re
from pathlib import Path

from rpycdl.defaults import MONITOR_PORT
from rpycdl.gpu.inventory import FakeInventory
from rpycdl.monitor.metrics import HostCollector

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
SUFFIXES = {"_bucket": "histogram", "_sum": "histogram", "_count": "histogram", "_total": "counter"}


def test_the_grafana_dashboard_queries_only_what_the_monitor_exposes(tmp_path):
    families = {family.name: family.type for family in
                HostCollector(FakeInventory("fake:2"), str(tmp_path / "locks"), str(tmp_path / "state")).collect()}
    dashboard = json.loads((DASHBOARDS / "rpycdl.json").read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queries += [variable["query"] for variable in dashboard["templating"]["list"] if variable["type"] == "query"]
    named = {name for query in queries for name in re.findall(r"\brpycdl_[a-z_]+", query)}
    assert len(named) >= 8
    for name in named:
        suffix = next((suffix for suffix in SUFFIXES if name.endswith(suffix) and name[:-len(suffix)] in families), "")
        base = name[:-len(suffix)] if suffix else name
        assert base in families, f"the dashboard asks for {name}, which the monitor does not expose"
        assert families[base] == SUFFIXES.get(suffix, "gauge"), (name, families[base])
    assert {panel["id"] for panel in dashboard["panels"]} == set(range(1, len(dashboard["panels"]) + 1))


def test_the_scrape_example_targets_the_monitors_port():
    assert f'targets: ["gpu01:{MONITOR_PORT}"' in (DASHBOARDS / "prometheus.yml").read_text()
