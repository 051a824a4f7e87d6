"""Promises 1, 3 and 8 under chaos (issues 13, 15): kills at random while clients run whole-GPU and shared jobs,
attached and detached."""

from __future__ import annotations

import pytest
from chaos import ChaosSettings, run_chaos


@pytest.mark.slow
def test_no_overcommit_and_no_leak_under_chaos(cluster, tmp_path):
    """Two fake:4 servers on one lock directory, six clients, 25 s of kills (connection processes
    right after a grant, job processes, their children, server parents, clients): no GPU ever
    over-committed, no grant outliving its job by a second, everything clean a second after the end."""
    result = run_chaos(cluster, tmp_path / "chaos", ChaosSettings())
    print(result.summary())
    missing = result.tested()
    assert not missing, "the chaos did not test what it should: " + "; ".join(missing) + "\n" + result.summary()
    problems = result.problems()
    assert not problems, "\n".join(problems) + "\n" + result.summary()
