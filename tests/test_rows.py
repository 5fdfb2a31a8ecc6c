"""The row contract's one ``verifier_metadata`` rule, and every place a row enters the recipe applying it the same way.

What the real server does with each odd spec is pinned in ``tests/test_real_server_raw.py``; these tests pin the rule.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_browser import preflight
from nemo_gym_browser.dataset import BrowserJSONLDataset
from nemo_gym_browser.gym_contract import environment
from nemo_gym_browser.gym_contract.rows import VERIFIER_KEYS, RowValueError, validate_verifier_metadata
from nemo_gym_browser.task_lists import tasks
from nemo_gym_browser.task_lists.tasks import InputError


def refusal(spec: Any) -> str:
    with pytest.raises(RowValueError) as raised:
        validate_verifier_metadata(spec)
    return str(raised.value)


# ----------------------------------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("key", VERIFIER_KEYS)
def test_one_known_key_with_a_string_is_accepted_as_a_fresh_copy(key):
    spec = {key: "About"}
    accepted = validate_verifier_metadata(spec)
    assert accepted == {key: "About"}
    accepted[key] = "changed"
    assert spec == {key: "About"}


@pytest.mark.parametrize("spec", [None, {}, {"dom_contains": None}], ids=["none", "empty", "nulls-only"])
def test_no_spec_means_none_so_the_judge_grades_the_task(spec):
    assert validate_verifier_metadata(spec) is None


def test_null_values_are_dropped_before_the_rule_so_they_never_reach_the_server():
    assert validate_verifier_metadata({"final_url": None, "url_contains": "about", "answer_equals": None}) == {
        "url_contains": "about"
    }


@pytest.mark.parametrize("pair", list(itertools.combinations(VERIFIER_KEYS, 2)), ids="+".join)
def test_two_grading_keys_are_refused_naming_both_the_precedence_and_the_key_the_server_would_grade(pair):
    first, second = pair
    for spec in ({first: "a", second: "b"}, {second: "b", first: "a"}):
        message = refusal(spec)
        assert message.startswith(f"verifier_metadata has 2 grading keys {[first, second]}, but the server grades only")
        assert "answer_equals > final_url > url_contains > dom_contains" in message
        assert f"here {first!r}, ignoring the rest. Keep exactly one" in message


def test_all_four_keys_are_refused_as_four():
    assert refusal(dict.fromkeys(VERIFIER_KEYS, "x")).startswith(
        f"verifier_metadata has 4 grading keys {list(VERIFIER_KEYS)}"
    )


@pytest.mark.parametrize(
    "spec", [{"title_is": "x"}, {"url_contains": "about", "title_is": "x"}], ids=["alone", "beside-a-known-key"]
)
def test_an_unknown_key_is_refused_listing_the_known_ones(spec):
    message = refusal(spec)
    assert message.startswith(f"unknown verifier_metadata keys ['title_is']: the server knows {list(VERIFIER_KEYS)}")


@pytest.mark.parametrize("value", ["", "   ", 1999, True, ["about"], {"text": "about"}])
def test_a_value_that_is_not_a_non_empty_string_is_refused_naming_its_key(value):
    assert (
        refusal({"url_contains": value})
        == f"verifier_metadata['url_contains'] must be a non-empty string, got {value!r}"
    )


@pytest.mark.parametrize("spec", ["final_url", ["final_url"], 3], ids=["str", "list", "int"])
def test_a_spec_that_is_not_an_object_is_refused(spec):
    assert refusal(spec) == f"verifier_metadata must be an object, got {type(spec).__name__}"


def test_a_refusal_is_a_value_error_so_callers_catching_value_error_still_catch_it():
    assert issubclass(RowValueError, ValueError)


# ------------------------------------------------------------------------------------ every entry point, one rule

BAD_SPECS = [
    pytest.param({"final_url": "https://a.example/", "dom_contains": "A"}, id="two-keys"),
    pytest.param({"url_contain": "about"}, id="unknown-key"),
    pytest.param({"dom_contains": ""}, id="empty-value"),
    pytest.param({"answer_equals": 42}, id="number"),
]
LOCATION = "tasks.jsonl:7"


def nemo_row(spec: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": "Open About."}, "task_id": "t1", "verifier_metadata": spec}


# Each entry point: (the location its errors start with, the error type it raises, a call that loads one row and
# returns the spec the episode will carry).
Entry = tuple[str, type[Exception], Callable[[], Any]]


def through_webvoyager_input(spec: Any, tmp_path: Path) -> Entry:
    record = {"id": "A--1", "ques": "Open About.", "web": "https://a.example/", "verifier_metadata": spec}
    return LOCATION, tasks.InputError, lambda: tasks.task_from_webvoyager(record, LOCATION).verifier_metadata


def through_nemo_gym_input(spec: Any, tmp_path: Path) -> Entry:
    return LOCATION, tasks.InputError, lambda: tasks.task_from_nemo_gym_row(nemo_row(spec), LOCATION).verifier_metadata


def through_the_dataset(spec: Any, tmp_path: Path) -> Entry:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(nemo_row(spec)) + "\n")

    def load() -> Any:
        return BrowserJSONLDataset([str(path)])[0]["tools_kwargs"]["browser"]["create_kwargs"]["verifier_metadata"]

    return f"{path}:1", InputError, load


def through_preflight(spec: Any, tmp_path: Path) -> Entry:
    """A sample as a custom dataset class might build it, without applying the rule itself; what it returns is
    whether the row needs the judge, so an accepted spec reads as False."""
    sample = {
        "tools_kwargs": {"browser": {"create_kwargs": {"task_id": "t1", "verifier_metadata": spec}}},
        "extra_info": {"source": LOCATION},
    }
    return LOCATION, preflight.CheckFailed, lambda: preflight.row_facts(sample, "train row 0").needs_judge


ENTRY_POINTS = [through_webvoyager_input, through_nemo_gym_input, through_the_dataset, through_preflight]


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda entry: entry.__name__)
@pytest.mark.parametrize("spec", BAD_SPECS)
def test_every_entry_point_refuses_what_the_rule_refuses_with_the_rule_s_message_at_its_location(tmp_path, entry, spec):
    location, error, load = entry(spec, tmp_path)
    with pytest.raises(error) as raised:
        load()
    assert str(raised.value) == f"{location}: {refusal(spec)}"


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_the_environment_client_exports_the_same_rule_for_callers_without_a_location(spec):
    with pytest.raises(RowValueError) as raised:
        environment.validate_verifier_metadata(spec)
    assert str(raised.value) == refusal(spec)


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda entry: entry.__name__)
def test_every_entry_point_accepts_one_key_and_drops_nulls(tmp_path, entry):
    _, _, load = entry({"url_contains": "about", "dom_contains": None}, tmp_path)
    expected = False if entry is through_preflight else {"url_contains": "about"}
    assert load() == expected
