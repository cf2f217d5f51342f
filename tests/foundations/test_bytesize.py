"""Byte sizes come from users and files: every text either parses to a sane size or is one ValueError."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from treetrain.bytesize import MAX_BYTES, format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GiB", 8 * 2**30), ("1.5GB", 1_500_000_000), ("512 mib", 512 * 2**20), ("1000000", 10**6), (123, 123)],
)
def test_parses_what_people_write(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text", ["1e308GiB", "1e400", "2EiB", 2**70, "9" * 400, -1, "-1GiB", "8 parsecs", ""]
)
def test_refuses_sizes_no_machine_has_and_text_that_is_not_a_size(text: str | int) -> None:
    with pytest.raises(ValueError):
        parse_bytes(text)


@given(
    st.text(max_size=60)
    | st.integers()
    | st.from_regex(r"[0-9]{1,400}(\.[0-9]+)?(e[0-9]{1,4})?[GMKT]i?B", fullmatch=True)
)
def test_any_input_is_a_bounded_size_or_a_value_error(text: str | int) -> None:
    try:
        n = parse_bytes(text)
    except ValueError:
        return
    assert 0 <= n <= MAX_BYTES


def test_format_reaches_the_largest_accepted_size() -> None:
    assert format_bytes(MAX_BYTES) == "1.0 EiB"
