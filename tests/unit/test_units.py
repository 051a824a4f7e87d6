"""Sizes as people write and read them (rpycdl.units)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rpycdl.errors import InvalidRequestError
from rpycdl.units import GiB, MiB, format_duration, format_size, parse_duration, parse_size


@pytest.mark.parametrize(("text", "size"), [("16GiB", 16 * GiB), ("512 MiB", 512 * MiB), ("8GB", 8 * 10**9),
                                             ("1.5GiB", 3 * GiB // 2), ("42", 42), ("1kib", 1024)])
def test_sizes_people_write_are_read(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "1 GiBs", "1e9", "12 furlongs"])
def test_what_is_not_a_size_says_so(text):
    with pytest.raises(InvalidRequestError, match="not a memory size"):
        parse_size(text)


@pytest.mark.parametrize(("size", "text"), [(0, "0 B"), (512 * MiB, "512 MiB"), (GiB, "1 GiB"),
                                             (int(79.6 * GiB), "79.6 GiB"), (1023, "1023 B")])
def test_sizes_are_shown_in_words(size, text):
    assert format_size(size) == text


@given(st.integers(0, 2**50))
def test_a_shown_size_reads_back_to_within_a_twentieth_of_its_unit(size):
    shown = format_size(size)
    unit = {"B": 1, "KiB": 1024, "MiB": MiB, "GiB": GiB, "TiB": 1024 * GiB}[shown.split()[1]]
    assert abs(parse_size(shown.replace(" ", "")) - size) <= unit * 0.05 + 1


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("30m", 1800), ("12h", 43200), ("7d", 604800),
                                               ("2w", 1209600), ("1.5h", 5400), (" 2D ", 172800)])
def test_durations_people_write_are_read(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "-1d", "7 days", "1y", "d", "1e3s", "inf"])
def test_what_is_not_a_duration_says_so(text):
    with pytest.raises(InvalidRequestError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (45, "45s"), (185, "3m05s"), (7620, "2h07m"),
                                               (7200, "2h"), (273600, "3d04h"), (604800, "7d"), (-3, "0s")])
def test_durations_are_shown_in_words(seconds, text):
    assert format_duration(seconds) == text


@given(st.integers(0, 400 * 86400))
def test_a_shown_duration_reads_back_to_within_its_smaller_unit(seconds):
    text = format_duration(seconds)
    first = re.match(r"\d+[smhd]", text).group(0)
    smaller = {"s": 1, "m": 1, "h": 60, "d": 3600}[first[-1]]
    rest = text[len(first):]
    shown = parse_duration(first) + (parse_duration(rest.lstrip("0") or "0") if rest else 0)
    assert 0 <= seconds - shown < smaller
