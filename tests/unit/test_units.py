"""Sizes as people write and read them (rpycdl.units)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rpycdl.errors import InvalidRequestError
from rpycdl.units import GiB, MiB, format_size, parse_size


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
