"""The gate's bounds: --max-startups as OpenSSH's MaxStartups reads it, and its random early drop."""

from __future__ import annotations

import pytest

from rpycdl.errors import InvalidRequestError
from rpycdl.server.gate import Startups, parse_max_startups


def test_max_startups_reads_low_rate_high_or_one_number():
    assert parse_max_startups("10:30:100", 512) == (10, 30, 100)
    assert parse_max_startups("50", 512) == (50, 100, 50)


@pytest.mark.parametrize("text", ["", "a:b:c", "10:30", "1:2:3:4", "100:30:10", "10:101:100", "0:30:100", "10:30:513"])
def test_max_startups_refuses_what_it_cannot_take(text):
    with pytest.raises(InvalidRequestError, match="--max-startups"):
        parse_max_startups(text, 512)


def test_a_new_connection_is_dropped_with_a_chance_rising_from_rate_at_low_to_all_at_high():
    startups = Startups(low=10, rate=30, high=100, per_source=16, grace=5.0)
    assert startups.drop_chance(0) == startups.drop_chance(9) == 0.0
    assert startups.drop_chance(10) == pytest.approx(0.30)
    assert startups.drop_chance(55) == pytest.approx(0.65)
    assert startups.drop_chance(100) == startups.drop_chance(1000) == 1.0
    hard = Startups(low=50, rate=100, high=50, per_source=16, grace=5.0)  # "50": a hard bound
    assert hard.drop_chance(49) == 0.0 and hard.drop_chance(50) == 1.0
