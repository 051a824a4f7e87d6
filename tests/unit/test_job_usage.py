"""What ended jobs used, as their servers measured it at their end (peak memory, CPU time, most processes), on
a ledger written here: in the monitor's metrics (rpycdl.monitor.metrics), counted once by service, the jobs not
measured left out; in a job's JSON for the dashboard (rpycdl.monitor.host), for its owner only."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rpycdl.gpu.inventory import FakeInventory
from rpycdl.monitor.host import HostView
from rpycdl.monitor.metrics import HostCollector
from rpycdl.scheduler.ledger import JobRecord, JobState, Ledger, new_job_id
from rpycdl.security import auth
from rpycdl.units import GiB, MiB


def scrape(registry: CollectorRegistry) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of the registry's exposition, by name, as Prometheus reads it."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def ended(service: str, **used) -> JobRecord:
    now = time.time()
    return JobRecord(job_id=new_job_id(), server_id="s", client="127.0.0.1:1", ngpus=1, state=JobState.SUCCEEDED,
                     submitted=now - 10, started=now - 9, ended=now, service=service, user="alice", **used)


def test_ended_jobs_peak_memory_and_cpu_time_are_counted_once_by_service(tmp_path):
    state = str(tmp_path / "state")
    registry = CollectorRegistry()
    registry.register(HostCollector(FakeInventory("fake:2"), str(tmp_path / "locks"), state))
    assert "rpycdl_job_cpu_seconds_total" not in scrape(registry)  # nothing ended yet
    ledger = Ledger(state)
    for record in (ended("pytorch", peak_memory=100 * MiB, cpu_seconds=12.5, max_procs=3),
                   ended("pytorch", peak_memory=5 * GiB, cpu_seconds=3600.25, max_procs=40),
                   ended("pytorch"),  # a server that cannot fence: not measured
                   ended("tensorflow", peak_memory=2 * GiB, cpu_seconds=0.5)):
        assert ledger.save(record)
    samples = scrape(registry)

    def value(name: str, **labels: str) -> float | None:
        found = [number for got, number in samples.get(name, []) if labels.items() <= got.items()]
        assert len(found) <= 1, (name, labels, found)
        return found[0] if found else None

    assert value("rpycdl_job_run_seconds_count", service="pytorch") == 3  # every ended job runs
    assert value("rpycdl_job_peak_memory_bytes_count", service="pytorch") == 2  # the measured ones
    assert value("rpycdl_job_peak_memory_bytes_sum", service="pytorch") == 100 * MiB + 5 * GiB
    assert value("rpycdl_job_peak_memory_bytes_bucket", service="pytorch", le="6.7108864e+07") == 0  # 64 MiB
    assert value("rpycdl_job_peak_memory_bytes_bucket", service="pytorch", le="2.68435456e+08") == 1  # 256 MiB
    assert value("rpycdl_job_peak_memory_bytes_bucket", service="pytorch", le="4.294967296e+09") == 1  # 4 GiB
    assert value("rpycdl_job_peak_memory_bytes_bucket", service="pytorch", le="1.7179869184e+10") == 2  # 16 GiB
    assert value("rpycdl_job_peak_memory_bytes_bucket", service="pytorch", le="+Inf") == 2
    assert value("rpycdl_job_cpu_seconds_total", service="pytorch") == pytest.approx(3612.75)
    assert value("rpycdl_job_cpu_seconds_total", service="tensorflow") == pytest.approx(0.5)
    assert value("rpycdl_job_peak_memory_bytes_count", service="tensorflow") == 1
    assert scrape(registry) == samples  # counted once, however often it is scraped


def test_a_jobs_json_says_what_it_used_to_its_owner_and_none_where_not_measured(tmp_path):
    state = str(tmp_path / "state")
    ledger = Ledger(state)
    used, unmeasured = ended("pytorch", peak_memory=3 * GiB, cpu_seconds=12.5, max_procs=4), ended("pytorch")
    assert ledger.save(used) and ledger.save(unmeasured)
    view = HostView(FakeInventory("fake:2"), str(tmp_path / "locks"), state)
    row = view.job(used.job_id, auth.declared("alice"))["job"]
    assert (row["peak_memory"], row["cpu_seconds"], row["max_procs"]) == (3 * GiB, 12.5, 4)
    row = view.job(unmeasured.job_id, auth.declared("alice"))["job"]
    assert (row["peak_memory"], row["cpu_seconds"], row["max_procs"]) == (None, None, None)
    for other in (None, auth.declared("bob"), auth.Identity("alice", verified=True)):  # not hers to see
        row = view.job(used.job_id, other)["job"]
        assert row["reduced"] and not {"peak_memory", "cpu_seconds", "max_procs"} & set(row), other
