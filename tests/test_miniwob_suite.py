"""The MiniWoB++ suite offline: the task table against the installed wheel, the seeds' split, the grade's codes and key
file, the adapted pages and what the site answers (over HTTP, no browser), and the rows.

The real server and Chromium play the same pages in ``tests/test_miniwob_integration.py``.
"""

from __future__ import annotations

import http.client
import json
import re
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from nemo_gym_browser.dataset import BrowserJSONLDataset
from nemo_gym_browser.local.miniwob import grading, inventory, pages, suite
from nemo_gym_browser.local.miniwob.site import MiniWobSite, task_url

KEY = grading.GradeKey(bytes(range(32)))


@pytest.fixture(scope="module")
def site():
    with MiniWobSite(KEY, port=0) as served:
        yield served


def fetch(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode("utf-8", "replace")


# ----- the task table -------------------------------------------------------------------------------------------------


def test_every_task_of_the_wheel_is_either_included_or_excluded_with_a_reason_and_no_task_is_both():
    included, excluded = inventory.included_tasks(), [entry.task for entry in inventory.EXCLUDED]
    assert len(set(included)) == len(included) and len(set(excluded)) == len(excluded)
    assert not set(included) & set(excluded)
    assert sorted(included + excluded) == pages.task_names()
    assert len(pages.task_names()) == 130
    assert all(entry.detail and entry.limit.value for entry in inventory.EXCLUDED)
    assert all(entry.how for entry in inventory.INCLUDED)


def test_the_limits_of_nemo_gyms_observation_and_action_model_are_told_apart_from_the_pages_own():
    marked = {limit for limit in inventory.Limit if limit.nemo_gym}
    assert marked == {
        inventory.Limit.UNLISTED,
        inventory.Limit.SELECT,
        inventory.Limit.TEXTAREA,
        inventory.Limit.INPUT_KIND,
        inventory.Limit.KEYS,
    }
    assert inventory.excluded_by_task()["click-link"].limit.nemo_gym
    assert not inventory.excluded_by_task()["drag-box"].limit.nemo_gym


def test_training_and_held_back_seeds_never_meet_and_are_the_same_for_every_call():
    train, held_back = inventory.seeds("train", 400), inventory.seeds("heldback", 100)
    assert not set(train) & set(held_back)
    assert all(seed % 5 == 4 for seed in held_back) and not any(seed % 5 == 4 for seed in train)
    assert held_back[:3] == [4, 9, 14] and train[:5] == [0, 1, 2, 3, 5]
    assert inventory.seeds("train", 400) == train
    with pytest.raises(ValueError, match="split must be one of"):
        inventory.seeds("test", 1)


# ----- the grade ------------------------------------------------------------------------------------------------------


def test_a_completion_code_names_one_task_seed_and_key_and_the_key_never_shows_in_its_repr():
    code = KEY.completion_code("click-button", 4)
    assert re.fullmatch(r"[0-9a-f]{32}", code)
    assert code == grading.GradeKey(bytes(range(32))).completion_code("click-button", 4)
    others = {
        KEY.completion_code("click-button", 9),
        KEY.completion_code("enter-text", 4),
        grading.GradeKey(bytes(range(1, 33))).completion_code("click-button", 4),
    }
    assert code not in others and len(others) == 3
    assert grading.verifier_metadata(KEY, "click-button", 4) == {"dom_contains": code}
    assert bytes(range(32)).hex() not in repr(KEY) and "secret" not in repr(KEY)


def test_a_key_file_is_made_once_readable_by_its_owner_only_and_a_broken_one_is_refused(tmp_path):
    path = tmp_path / "keys" / "miniwob.key"
    made = grading.GradeKey.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert grading.GradeKey.load_or_create(path) == made
    path.write_text("not hex\n")
    with pytest.raises(grading.GradeKeyError, match="not a MiniWoB grade key"):
        grading.GradeKey.load(path)
    with pytest.raises(grading.GradeKeyError, match="at least 16 bytes"):
        grading.GradeKey(b"short")


# ----- the adapted pages and the site ---------------------------------------------------------------------------------


def test_an_adapted_page_is_the_wheels_page_with_one_script_after_core_js_holding_the_code_in_a_closure():
    source = pages.read_task_page("click-button")
    code = KEY.completion_code("click-button", 4)
    adapted = pages.adapted_page(source, task="click-button", seed=4, code=code)
    script = pages.adapter_script("click-button", 4, code)
    assert adapted.replace("\n" + script, "", 1) == source
    assert adapted.index(pages.CORE_SCRIPT) < adapted.index(script) < adapted.index("var genProblem")
    assert adapted.count(code) == 1 and adapted.index(code) > adapted.index("(function () {")
    assert "document.currentScript.remove()" in script and "Math.seedrandom(SEED)" in script
    with pytest.raises(pages.PageError, match="not a MiniWoB task name"):
        pages.adapter_script("../core/core", 4, code)
    with pytest.raises(pages.PageError, match="seed is an integer"):
        pages.adapter_script("click-button", -1, code)
    with pytest.raises(pages.PageError, match="exactly once"):
        pages.adapted_page("<html></html>", task="click-button", seed=4, code=code)


def test_the_site_serves_a_task_page_with_its_seeds_code_and_the_wheels_scripts_unchanged(site):
    status, content_type, page = fetch(site.task_url("enter-text", 9))
    assert status == 200 and content_type.startswith("text/html")
    assert KEY.completion_code("enter-text", 9) in page
    assert KEY.completion_code("enter-text", 14) not in page
    status, content_type, core = fetch(f"{site.url}/core/core.js")
    assert status == 200 and content_type.startswith("text/javascript")
    assert core == (pages.html_root() / "core" / "core.js").read_text(encoding="utf-8")
    assert site.task_url("enter-text", 9) == task_url("enter-text", 9, port=site.port)


@pytest.mark.parametrize(
    "path",
    [
        "/miniwob/{marker}.html?seed=4",
        "/miniwob/click-button.html?seed={marker}",
        "/miniwob/click-button.html?seed=4&note={marker}",
        "/miniwob/click-button.html",
        "/core/{marker}.js",
        "/core/../miniwob/click-button.html",
        "/core/jquery-ui/index.html",
        "/{marker}",
        "/",
    ],
)
def test_no_answer_of_the_site_repeats_what_the_request_wrote(site, path):
    marker = "f00dfeedc0ffee42"
    status, _, body = fetch(site.url + path.format(marker=marker))
    assert status in (400, 404)
    assert marker not in body and "click-button" not in body


def test_a_request_for_another_host_name_than_the_sites_own_is_refused(site):
    connection = http.client.HTTPConnection("127.0.0.1", site.port, timeout=10)
    try:
        connection.request("GET", "/miniwob/click-button.html?seed=4", headers={"Host": f"localhost:{site.port}"})
        answer = connection.getresponse()
        body = answer.read().decode()
    finally:
        connection.close()
    assert answer.status == 421 and KEY.completion_code("click-button", 4) not in body


# ----- the rows -------------------------------------------------------------------------------------------------------


def test_the_rows_start_on_the_site_grade_on_the_code_and_keep_it_out_of_the_prompt(tmp_path: Path):
    tasks = ["click-button", "enter-text"]
    written = suite.write_rows(KEY, tmp_path, per_task={"train": 2, "heldback": 1}, tasks=tasks)
    rows = [json.loads(line) for line in written["train"].read_text().splitlines()]
    assert [row["task_id"] for row in rows] == [
        "miniwob--click-button--0",
        "miniwob--click-button--1",
        "miniwob--enter-text--0",
        "miniwob--enter-text--1",
    ]
    first = rows[0]
    code = KEY.completion_code("click-button", 0)
    assert first["initial_url"] == "http://127.0.0.1:8766/miniwob/click-button.html?seed=0"
    assert first["verifier_metadata"] == {"dom_contains": code}
    assert first["data_source"] == "miniwob/click-button"
    assert code not in json.dumps(first["responses_create_params"])
    samples = BrowserJSONLDataset(str(written["heldback"]))
    assert len(samples) == 2 and samples[0]["extra_info"]["task_metadata"]["seed"] == 4
    with pytest.raises(ValueError, match="not included MiniWoB tasks: drag-box"):
        suite.suite_rows(KEY, "train", 1, tasks=["drag-box"])


def test_the_command_writes_both_splits_with_a_key_it_makes_and_refuses_a_broken_key(tmp_path, capsys):
    key_file, output = tmp_path / "k", tmp_path / "rows"
    argv = ["rows", "--key-file", str(key_file), "--output-dir", str(output), "--tasks", "click-test"]
    assert suite.main([*argv, "--train-per-task", "3", "--heldback-per-task", "2"]) == 0
    assert len((output / "miniwob_train.jsonl").read_text().splitlines()) == 3
    assert len((output / "miniwob_heldback.jsonl").read_text().splitlines()) == 2
    key_file.write_text("zz")
    assert suite.main(argv) == 2
    assert "not a MiniWoB grade key" in capsys.readouterr().err


# ----- the manual ---------------------------------------------------------------------------------------------------


def test_the_manuals_tables_are_the_measured_solver_table_and_the_inventorys_exclusions():
    from nemo_gym_browser.local.miniwob import evaluate

    root = Path(__file__).resolve().parent.parent
    manual = (root / "docs" / "miniwob.md").read_text(encoding="utf-8")
    measured = json.loads((root / "bench" / "miniwob_solver.json").read_text(encoding="utf-8"))
    assert evaluate.solver_table(measured) in manual
    assert evaluate.exclusion_table() in manual
    at_once = json.loads((root / "bench" / "miniwob_finish_at_once.json").read_text(encoding="utf-8"))
    assert sorted(at_once["tasks"]) == sorted(inventory.included_tasks())
    assert all(row["successes"] == 0 and row["invalid"] == 0 for row in at_once["tasks"].values())
    summary = measured["summary"]
    assert f"{summary['episodes']} episodes in {summary['play_s']:.0f} s" in manual
    assert f"{summary['episodes_per_minute']:.0f} episodes per minute" in manual
    assert f"load average {summary['machine']['load_average_1min']:.1f} when the run started" in manual


def test_a_browser_that_goes_away_mid_answer_is_no_error_of_the_sites_but_anything_else_still_is(capsys):
    from nemo_gym_browser.local.miniwob.site import _Server

    server = _Server.__new__(_Server)  # the error hook only: no socket
    for error in (BrokenPipeError(32, "Broken pipe"), ValueError("a bug")):
        try:
            raise error
        except Exception:
            server.handle_error(None, ("127.0.0.1", 1))
    printed = capsys.readouterr().err
    assert "ValueError: a bug" in printed and "BrokenPipeError" not in printed
