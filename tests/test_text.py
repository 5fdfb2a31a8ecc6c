"""How text is shortened for messages, listings and trajectory records."""

from __future__ import annotations

import pytest

from nemo_gym_browser.gym_contract.text import shorten


def test_text_within_the_limit_is_returned_unchanged() -> None:
    assert shorten("abcdef", 6) == "abcdef"


def test_longer_text_is_cut_to_exactly_the_limit_ending_in_an_ellipsis() -> None:
    assert shorten("abcdefgh", 6) == "abcde…"
    assert len(shorten("x" * 500, 120)) == 120


def test_a_caller_can_choose_another_marker() -> None:
    assert shorten("abcdefgh", 6, "...") == "abc..."


def test_one_line_collapses_whitespace_before_measuring() -> None:
    assert shorten("a\n  b\tc", 5, one_line=True) == "a b c"
    assert shorten("a\n  b\tc d", 6, one_line=True) == "a b c…"
    assert shorten("a\nb", 5) == "a\nb"


def test_a_limit_shorter_than_the_marker_is_refused() -> None:
    with pytest.raises(ValueError, match="shorter than the marker"):
        shorten("abcdef", 2, "...")
