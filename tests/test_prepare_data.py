"""prepare_webvoyager_data.py: the real WebVoyager files end to end, the Hugging Face paths, the split, bad input.

The Hugging Face tests build real datasets with ``datasets`` and read them back through the same calls the command
makes for a Hub name: ``load_dataset`` on a local folder laid out like a Hub dataset repository
(``data/<split>-*.parquet``) resolves through the same builder as a downloaded repository, and
``load_from_disk`` on a ``save_to_disk`` folder.
This machine has no Hub access, so the only thing not exercised is the download itself; a socket guard proves that
nothing tried to open a connection.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_gym_browser import prepare_webvoyager_data as prep
from nemo_gym_browser.gym_contract.browser_calls import TOOL_NAMES
from nemo_gym_browser.task_lists import task_rows
from nemo_gym_browser.task_lists.named_dates import check_dates, find_named_dates
from nemo_gym_browser.testing.webvoyager import missing_message, webvoyager_dir

REPO = Path(__file__).resolve().parents[1]
WEBVOYAGER = webvoyager_dir()
TASKS_FILE = WEBVOYAGER / "WebVoyager_data.jsonl"
ANSWERS_FILE = WEBVOYAGER / "reference_answer.json"
# A fixed "today" keeps the stale-date figures stable; every dated WebVoyager task before 2050 is past by then.
TODAY = "2026-01-15"


@pytest.fixture(scope="module")
def webvoyager_tasks() -> list[dict]:
    assert TASKS_FILE.is_file() and ANSWERS_FILE.is_file(), missing_message(WEBVOYAGER)
    return [json.loads(line) for line in TASKS_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_the_webvoyager_files_are_read_from_the_named_folder_else_from_shared_beside_the_recipe_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("WEBVOYAGER_DATA_DIR", str(tmp_path))
    assert webvoyager_dir() == tmp_path
    monkeypatch.delenv("WEBVOYAGER_DATA_DIR")
    assert webvoyager_dir() == REPO.parent / "shared" / "data" / "webvoyager"  # no machine's absolute path
    assert "WEBVOYAGER_DATA_DIR" in missing_message(tmp_path) and str(tmp_path) in missing_message(tmp_path)


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = prep.main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def table_row(stdout: str, first_cell: str) -> list[str]:
    """Cells of the summary-table line that starts with ``first_cell`` (columns are two or more spaces apart)."""
    if first_cell == "site":
        return ["site", "train", "val", "total", "golden", "possible", "no ref", "verifier", "past date", "no year"]
    line = next(line for line in stdout.splitlines() if re.match(rf"{re.escape(first_cell)}\s{{2,}}\d", line))
    return re.split(r"\s{2,}", line.strip())


def listed_stale(stdout: str) -> set[str]:
    return set(re.findall(r"^  (.+?--\d+) ", stdout, re.MULTILINE))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def task(n: int, site: str = "Allrecipes", **extra) -> dict:
    return {
        "web_name": site,
        "id": f"{site}--{n}",
        "ques": f"Find thing {n}.",
        "web": "https://www.example.com/",
    } | extra


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list:
    """Fail any socket connection that leaves this machine, and record the attempt."""
    attempts: list = []
    real_connect = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and host not in ("127.0.0.1", "::1", "localhost") and not host.startswith("/"):
            attempts.append(address)
            raise OSError(f"network access attempted in a test: {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return attempts


# ---------------------------------------------------------------------------------------------------------------------
# The real files


def test_the_full_webvoyager_file_becomes_one_row_per_task_with_its_reference_answer(
    tmp_path, capsys, webvoyager_tasks
):
    out = tmp_path / "out"
    code, stdout, _ = run(capsys, "--input", TASKS_FILE, "--reference-answers", ANSWERS_FILE, "--output-dir", out)

    assert code == 0
    train, val = read_jsonl(out / "train.jsonl"), read_jsonl(out / "val.jsonl")
    rows = train + val
    assert len(rows) == len(webvoyager_tasks) == 643
    assert sorted(row["task_id"] for row in rows) == sorted(t["id"] for t in webvoyager_tasks)
    # the last line of the file has no newline and is still a task
    assert webvoyager_tasks[-1]["id"] in {row["task_id"] for row in rows}
    by_id = {row["task_id"]: row for row in rows}
    for source in webvoyager_tasks:
        row = by_id[source["id"]]
        system, user = row["responses_create_params"]["input"]
        assert system["role"] == "system" and user["role"] == "user"
        assert source["ques"].strip() in user["content"] and source["web"] in user["content"]
        assert row["initial_url"] == source["web"]
        assert row["site"] == source["web_name"] and row["question"] == source["ques"].strip()
        assert row["data_source"] == "webvoyager"
        assert "verifier_metadata" not in row  # WebVoyager gives none: the judge grades these tasks
    reference = json.loads(ANSWERS_FILE.read_text())
    booking_3 = next(a for a in reference["Booking"]["answers"] if a["id"] == 3)
    assert by_id["Booking--3"]["reference_answer"] == booking_3["ans"]
    assert by_id["Booking--3"]["reference_type"] == booking_3["type"]
    types = [row["reference_type"] for row in rows]
    assert (types.count("golden"), types.count("possible")) == (143, 500)
    header = table_row(stdout, "site")
    total = dict(zip(header, table_row(stdout, "total"), strict=True))
    assert total == {
        "site": "total", "train": str(len(train)), "val": str(len(val)), "total": "643", "golden": "143",
        "possible": "500", "no ref": "0", "verifier": "0", "past date": total["past date"], "no year": "17",
    }  # fmt: skip
    assert table_row(stdout, "Booking")[3] == "44"
    assert f"wrote: {out / 'train.jsonl'} ({len(train)} rows), {out / 'val.jsonl'} ({len(val)} rows)" in stdout
    assert f"reference answers: {ANSWERS_FILE} (643, 643 used)" in stdout
    umask = os.umask(0)
    os.umask(umask)
    assert {path.name: path.stat().st_mode & 0o777 for path in out.iterdir()} == {
        "train.jsonl": 0o666 & ~umask, "val.jsonl": 0o666 & ~umask,
    }  # fmt: skip


def test_the_system_prompt_teaches_observe_first_element_ids_and_finish():
    prompt = task_rows.SYSTEM_PROMPT_BROWSER
    assert "`browser`" in prompt
    for action in ("observe", "navigate", "click", "type", "finish"):
        assert f"- {action}:" in prompt
    assert "your first call is observe" in prompt
    assert "Element ids come from the latest observation" in prompt
    assert "call finish exactly once with the answer" in prompt
    assert [tool["name"] for tool in task_rows.BROWSER_TOOL_SCHEMAS] == ["browser"]


def test_native_rows_teach_and_carry_nemo_gyms_five_browser_tools(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [task(0), task(1)])
    code, _, _ = run(capsys, "--input", source, "--output-dir", tmp_path / "out", "--tool-interface", "native")

    assert code == 0
    rows = read_jsonl(tmp_path / "out" / "train.jsonl") + read_jsonl(tmp_path / "out" / "val.jsonl")
    tools = rows[0]["responses_create_params"]["tools"]
    assert tuple(tool["name"] for tool in tools) == TOOL_NAMES
    system = rows[0]["responses_create_params"]["input"][0]["content"]
    assert all(name in system for name in TOOL_NAMES) and "`browser`" not in system


def test_the_stale_date_report_lists_real_tasks_whose_dates_are_all_past(tmp_path, capsys):
    code, stdout, _ = run(
        capsys, "--input", TASKS_FILE, "--output-dir", tmp_path / "out", "--today", TODAY, "--dry-run"
    )

    assert code == 0
    listed = listed_stale(stdout)
    assert "tasks naming only dates before 2026-01-15: 71 (kept;" in stdout
    assert len(listed) == 71
    assert {"Booking--5", "Booking--40", "Google Flights--12", "Apple--9", "ArXiv--42", "ESPN--15"} <= listed
    # a date still to come keeps a task ("between February 12, 2024 and August 9, 2050"), and so does a date
    # without a year ("December 25-26"): its next occurrence is always ahead
    assert "Wolfram Alpha--37" not in listed and "Booking--0" not in listed and "Google Flights--0" not in listed
    assert re.search(r"^  Booking--40 +2024-03-06\.\.2024-03-08 +I need to choose a hotel in Shenzhen", stdout, re.M)
    assert table_row(stdout, "Booking")[-2:] == ["32", "8"]
    assert not (tmp_path / "out").exists()
    assert "dry run: nothing written" in stdout


def test_exclude_stale_dates_drops_exactly_the_reported_tasks(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, _ = run(capsys, "--input", TASKS_FILE, "--output-dir", out, "--today", TODAY, "--exclude-stale-dates")

    assert code == 0
    kept = {row["task_id"] for row in read_jsonl(out / "train.jsonl") + read_jsonl(out / "val.jsonl")}
    assert len(kept) == 643 - 71
    assert "Booking--5" not in kept and "Wolfram Alpha--37" in kept and "Booking--0" in kept
    assert "dropped: 71 (past date: 71)" in stdout


def test_an_earlier_today_makes_fewer_tasks_stale(tmp_path, capsys):
    code, stdout, _ = run(capsys, "--input", TASKS_FILE, "--output-dir", tmp_path, "--today", "2024-01-01", "--dry-run")

    assert code == 0
    assert listed_stale(stdout) == {
        "ArXiv--42", "Booking--8", "ESPN--15", "ESPN--16", "GitHub--28", "Wolfram Alpha--10",
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Dates


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("schedule a pickup for January 10, 2024.", [(2024, 1, 10)]),
        ("a flight on Jan. 22.", [(None, 1, 22)]),
        ("from Dec 25th - Dec 26th", [(None, 12, 25), (None, 12, 26)]),
        ("stay from March 20-27, 2024, with", [(2024, 3, 20), (2024, 3, 27)]),
        ("from February 28 to March 2, 2024", [(2024, 2, 28), (2024, 3, 2)]),
        ("from December 28 to January 2, 2024", [(2023, 12, 28), (2024, 1, 2)]),
        ("select date (6 March to 8 March 2024)", [(2024, 3, 6), (2024, 3, 8)]),
        ("three nights from 1st Jan in Jakarta", [(None, 1, 1)]),
        ("from Jan 22 to 25 in Los Angeles", [(None, 1, 22), (None, 1, 25)]),
        ("from Jan 22 to 5 people", [(None, 1, 22)]),
        ("created after 2023-12-29.", [(2023, 12, 29)]),
        ("for 20/12/2023 - 21/12/2023.", [(2023, 12, 20), (2023, 12, 21)]),
        ("on 01/02/2023", [(2023, 2, 1)]),  # day/month order unknown: the later reading
        ("between 1 January 2000 and 1 January 2005", [(2000, 1, 1), (2005, 1, 1)]),
        ("leaving on 20 December and return on 23 December", [(None, 12, 20), (None, 12, 23)]),
        ("on February 29, 2024", [(2024, 2, 29)]),
        ("check 6-8 March 2024", [(2024, 3, 6), (2024, 3, 8)]),
    ],
)
def test_dates_named_in_questions_are_found_with_their_years(text, expected):
    assert [(d.year, d.month, d.day) for d in find_named_dates(text)] == expected


@pytest.mark.parametrize(
    "text",
    [
        "papers published in 2023",
        "the NBA Power Index 2023-24",
        "announced in December 2023",
        "you may 5 times try",
        "a Marathon 5 km route",
        "on February 30, 2024",
        "Oscars 2023: Must-See Moments!",
        "at 10:30 on the page",
    ],
)
def test_years_months_and_impossible_days_are_not_dates(text):
    assert find_named_dates(text) == []


def test_only_a_question_whose_latest_date_is_past_is_stale():
    today = dt.date(2026, 1, 15)
    assert check_dates("the NBA games played on December 25, 2023", today).past
    assert not check_dates("days between February 12, 2024 and August 9, 2050", today).past
    assert not check_dates("a hotel for December 25-26", today).past
    assert check_dates("a hotel for December 25-26", today).undated
    assert not check_dates("a flight on January 15, 2026", today).past  # today is not past
    assert not check_dates("book January 5, 2024 and return on December 25", today).past


# ---------------------------------------------------------------------------------------------------------------------
# The split


def test_the_split_is_deterministic_and_stable_when_tasks_are_added(tmp_path, capsys, webvoyager_tasks):
    half = write_jsonl(tmp_path / "half.jsonl", webvoyager_tasks[::2])
    for name, source in (("full_a", TASKS_FILE), ("full_b", TASKS_FILE), ("half", half)):
        assert run(capsys, "--input", source, "--output-dir", tmp_path / name, "--seed", "7")[0] == 0

    def assignment(name: str) -> dict[str, str]:
        return {
            row["task_id"]: split
            for split in ("train", "val")
            for row in read_jsonl(tmp_path / name / f"{split}.jsonl")
        }

    full, half_split = assignment("full_a"), assignment("half")
    assert (tmp_path / "full_a" / "val.jsonl").read_bytes() == (tmp_path / "full_b" / "val.jsonl").read_bytes()
    assert (tmp_path / "full_a" / "train.jsonl").read_bytes() == (tmp_path / "full_b" / "train.jsonl").read_bytes()
    assert all(full[task_id] == split for task_id, split in half_split.items())
    assert 0.07 < sum(split == "val" for split in full.values()) / len(full) < 0.13


def test_another_seed_gives_another_split():
    ids = [f"Site--{n}" for n in range(400)]
    first = [prep.split_of(task_id, 0, 0.2) for task_id in ids]
    second = [prep.split_of(task_id, 1, 0.2) for task_id in ids]
    assert first != second
    assert [prep.split_of(task_id, 0, 0.2) for task_id in ids] == first
    assert set(prep.split_of(task_id, 0, 0.0) for task_id in ids) == {"train"}


# ---------------------------------------------------------------------------------------------------------------------
# Filters, pass-through and metadata


def test_site_filters_and_limit_are_reported_as_dropped_rows(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, _ = run(
        capsys, "--input", TASKS_FILE, "--output-dir", out,
        "--include-site", "booking", "--include-site", "ArXiv", "--limit", "50",
    )  # fmt: skip

    assert code == 0
    rows = read_jsonl(out / "train.jsonl") + read_jsonl(out / "val.jsonl")
    assert len(rows) == 50 and {row["site"] for row in rows} == {"ArXiv", "Booking"}
    assert "dropped: 593 (--limit: 37, site filter: 556)" in stdout

    code, stdout, _ = run(capsys, "--input", TASKS_FILE, "--output-dir", out, "--exclude-site", "Google Flights")
    assert code == 0 and "dropped: 42 (site filter: 42)" in stdout


def test_extra_fields_are_kept_as_task_metadata_and_web_name_is_optional(tmp_path, capsys):
    source = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"id": "Coursera--1", "ques": "Find a course.", "web": "https://www.coursera.org/", "level": "easy"},
            {"id": "plain-id", "ques": "Find a page.", "web": "https://docs.example.org/a", "tags": ["x"]},
        ],
    )
    code, _, _ = run(capsys, "--input", source, "--output-dir", tmp_path / "out", "--val-fraction", "0")

    assert code == 0
    rows = {row["task_id"]: row for row in read_jsonl(tmp_path / "out" / "train.jsonl")}
    assert rows["Coursera--1"]["site"] == "Coursera" and rows["Coursera--1"]["task_metadata"] == {"level": "easy"}
    assert rows["plain-id"]["site"] == "docs.example.org" and rows["plain-id"]["task_metadata"] == {"tags": ["x"]}
    assert rows["plain-id"]["reference_answer"] is None
    assert read_jsonl(tmp_path / "out" / "val.jsonl") == []


ALIAS_PAIRS = [
    pytest.param("id", "task_id", id="id-task_id"),
    pytest.param("ques", "question", id="ques-question"),
    pytest.param("web", "start_url", id="web-start_url"),
    pytest.param("web", "initial_url", id="web-initial_url"),
    pytest.param("web_name", "site", id="web_name-site"),
]
ALIAS_VALUES = {
    "id": ("Allrecipes--{n}", "mirror-{n}"),
    "ques": ("Find thing {n}.", "Find another thing {n}."),
    "web": ("https://www.example.com/", "https://mirror.example.org/{n}"),
    "web_name": ("Allrecipes", "Mirror{n}"),
}


def alias_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning: ") and "different values" in line]


@pytest.mark.parametrize(("name", "alias"), ALIAS_PAIRS)
def test_a_row_with_a_field_and_its_alias_uses_the_webvoyager_field_and_keeps_the_alias_as_task_metadata(
    tmp_path, capsys, name, alias
):
    same, other = ALIAS_VALUES[name]
    rows = [
        task(0) | {alias: same.format(n=0)},  # the same value twice: no warning
        task(1) | {name: same.format(n=1), alias: other.format(n=1)},
        task(2) | {name: same.format(n=2), alias: other.format(n=2)},
    ]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    code, _, stderr = run(capsys, "--input", source, "--output-dir", tmp_path / "out", "--val-fraction", "0")

    assert code == 0, stderr
    written = read_jsonl(tmp_path / "out" / "train.jsonl")
    assert [row["task_id"] for row in written] == ["Allrecipes--0", "Allrecipes--1", "Allrecipes--2"]
    column = {"id": "task_id", "ques": "question", "web": "initial_url", "web_name": "site"}[name]
    assert [row[column] for row in written] == [same.format(n=n) for n in range(3)]
    assert [row["task_metadata"] for row in written] == [
        {alias: same.format(n=0)},
        {alias: other.format(n=1)},
        {alias: other.format(n=2)},
    ]
    (warning,) = alias_warnings(stderr)  # once per file, however many rows
    assert f"{source}: 2 rows give both '{name}' and '{alias}' with different values (first at {source}:2)" in warning
    assert f"'{name}' is used" in warning and f"'{alias}' is kept in task_metadata" in warning


def test_alias_conflicts_are_warned_once_per_input_file_and_not_at_all_without_them(tmp_path, capsys):
    first = write_jsonl(tmp_path / "a.jsonl", [task(0, task_id="a-0"), task(1, task_id="a-1")])
    second = write_jsonl(tmp_path / "b.jsonl", [task(2), task(3, task_id="b-3"), task(4, question="Other?")])
    clean = write_jsonl(tmp_path / "c.jsonl", [task(5, task_id="Allrecipes--5")])
    code, _, stderr = run(
        capsys, "--input", first, "--input", second, "--input", clean, "--output-dir", tmp_path / "out"
    )

    assert code == 0, stderr
    assert alias_warnings(stderr) == [
        f"warning: {first}: 2 rows give both 'id' and 'task_id' with different values (first at {first}:1); "
        "'id' is used (WebVoyager's key), 'task_id' is kept in task_metadata",
        f"warning: {second}: 1 row gives both 'id' and 'task_id' with different values (first at {second}:2); "
        "'id' is used (WebVoyager's key), 'task_id' is kept in task_metadata",
        f"warning: {second}: 1 row gives both 'ques' and 'question' with different values (first at {second}:3); "
        "'ques' is used, 'question' is kept in task_metadata",
    ]


def test_a_saved_dataset_with_both_id_and_task_id_columns_is_read_with_one_warning(tmp_path, capsys, no_network):
    import datasets

    records = [task(0, task_id="mirror-0"), task(1, task_id="mirror-1"), task(2, task_id="Allrecipes--2")]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    code, _, stderr = run(capsys, "--from-disk", tmp_path / "saved", "--output-dir", tmp_path / "out")

    assert code == 0, stderr
    rows = read_jsonl(tmp_path / "out" / "train.jsonl") + read_jsonl(tmp_path / "out" / "val.jsonl")
    assert sorted(row["task_id"] for row in rows) == ["Allrecipes--0", "Allrecipes--1", "Allrecipes--2"]
    (warning,) = alias_warnings(stderr)
    assert f"{tmp_path / 'saved'}: 2 rows give both 'id' and 'task_id'" in warning
    assert f"(first at {tmp_path / 'saved'}#0)" in warning
    assert no_network == []


def test_nemo_gym_rows_pass_through_validated_with_a_task_id_added(tmp_path, capsys):
    nemo_row = {
        "responses_create_params": {
            "input": [{"role": "developer", "content": "Use the tools."}, {"role": "user", "content": "Go to About."}],
            "tools": [{"type": "function", "name": "browser_observe", "parameters": {}}],
        },
        "initial_url": "site/index.html",
        "verifier_metadata": {"url_contains": "about.html", "dom_contains": None},
        "agent_ref": {"name": "interactive_browser_simple_agent"},
    }
    source = write_jsonl(tmp_path / "in.jsonl", [nemo_row, task(3, verifier_metadata={"answer_equals": "42"})])
    code, stdout, _ = run(capsys, "--input", source, "--output-dir", tmp_path / "out", "--val-fraction", "0")

    assert code == 0
    first, second = read_jsonl(tmp_path / "out" / "train.jsonl")
    expected = {**nemo_row, "verifier_metadata": {"url_contains": "about.html"}, "task_id": first["task_id"]}
    assert first == expected and first["task_id"].startswith("row-")
    assert second["verifier_metadata"] == {"answer_equals": "42"}
    assert "warning: the validation split is empty" not in stdout  # a fraction of 0 asks for no validation


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: exit 2, the place named, nothing written


BAD_INPUTS = [
    pytest.param([task(0), "{not json", task(2)], ":2: malformed JSON", id="malformed-json"),
    pytest.param([task(0), {"id": "A--1", "web": "https://a.example/"}], ":2: 'ques' must be a non-", id="missing"),
    pytest.param([task(0), task(1), task(0)], ":3: duplicate task id 'Allrecipes--0' (first at", id="duplicate-id"),
    pytest.param(
        [task(0, verifier_metadata={"url_contain": "x"})], ":1: unknown verifier_metadata keys ['url_contain']",
        id="unknown-verifier-key",
    ),
    pytest.param(
        [task(0, verifier_metadata={"dom_contains": "a", "url_contains": "b"})],
        ":1: verifier_metadata has 2 grading keys ['url_contains', 'dom_contains'], but the server grades only one",
        id="two-verifier-keys",
    ),
    pytest.param(
        [{"responses_create_params": {"input": "Go."}, "verifier_metadata": {"final_url": "a", "answer_equals": "b"}}],
        ":1: verifier_metadata has 2 grading keys ['answer_equals', 'final_url']", id="two-verifier-keys-nemo-row",
    ),
    pytest.param(
        [task(0, verifier_metadata={"answer_equals": " "})], ":1: verifier_metadata['answer_equals'] must be",
        id="blank-verifier-value",
    ),
    pytest.param([task(0, web="file:///etc/passwd")], ":1: 'web' must be an http(s) URL", id="not-a-web-url"),
    pytest.param([task(0), "[1, 2]"], ":2: expected a JSON object, got list", id="not-an-object"),
    pytest.param(
        [{"responses_create_params": {"input": [{"role": "system", "content": "hi"}]}}], ":1: ", id="no-user-message"
    ),
    pytest.param(["", "   "], "no task left to write", id="empty-result"),
]  # fmt: skip


@pytest.mark.parametrize(("lines", "message"), BAD_INPUTS)
def test_bad_input_exits_2_naming_the_line_and_writes_nothing(tmp_path, capsys, lines, message):
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out"
    code, stdout, stderr = run(capsys, "--input", source, "--output-dir", out)

    assert code == 2
    assert message in stderr
    assert str(source) in stderr
    assert "nothing written" in stderr and stdout == ""
    assert not out.exists()


def test_every_bad_line_is_reported_not_only_the_first(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", ["{", task(1), "[]", task(1)])
    code, _, stderr = run(capsys, "--input", source, "--output-dir", tmp_path / "out")

    assert code == 2
    assert re.findall(r"^error: .*in\.jsonl:(\d+): ", stderr, re.MULTILINE) == ["1", "3", "4"]


def test_bad_input_leaves_an_earlier_output_untouched(tmp_path, capsys):
    out = tmp_path / "out"
    assert run(capsys, "--input", write_jsonl(tmp_path / "good.jsonl", [task(0), task(1)]), "--output-dir", out)[0] == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}

    code, _, _ = run(capsys, "--input", write_jsonl(tmp_path / "bad.jsonl", [task(5), "{"]), "--output-dir", out)

    assert code == 2
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--include-site", "Bookng"], "unknown site 'Bookng' in a site filter; the input has: Allrecipes"),
        (["--exclude-site", "Allrecipes"], "no task left to write after the filters"),
        (["--reference-answers", "BROKEN"], "BROKEN.json:2: malformed JSON"),
        (["--reference-answers", "CONFLICT"], "differs from the one in --reference-answers"),
        (["--val-fraction", "1"], "--val-fraction must be in [0, 1)"),
        (["--limit", "0"], "--limit must be at least 1"),
    ],
)
def test_bad_options_and_reference_files_exit_2(tmp_path, capsys, argv, message):
    (tmp_path / "BROKEN.json").write_text('{\n  "Allrecipes": {"answers": [}\n}')
    (tmp_path / "CONFLICT.json").write_text(
        json.dumps({"Allrecipes": {"answers": [{"id": 0, "type": "golden", "ans": "b"}]}})
    )
    argv = [str(tmp_path / f"{arg}.json") if arg in ("BROKEN", "CONFLICT") else arg for arg in argv]
    source = write_jsonl(tmp_path / "in.jsonl", [task(0, reference_answer="a"), task(1)])
    code, _, stderr = run(capsys, "--input", source, "--output-dir", tmp_path / "out", *argv)

    assert code == 2
    assert message in stderr
    assert not (tmp_path / "out").exists()


def test_a_write_that_fails_midway_leaves_no_partial_file(tmp_path, capsys, monkeypatch):
    source = write_jsonl(tmp_path / "in.jsonl", [task(n) for n in range(40)])
    out = tmp_path / "new" / "out"
    calls = []

    def failing_fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:  # the second file: the first is complete but not yet renamed
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(prep.os, "fsync", failing_fsync)
    code, _, stderr = run(capsys, "--input", source, "--output-dir", out)

    assert code == 2 and "No space left on device" in stderr and "nothing written" in stderr
    assert len(calls) == 2
    assert not out.exists() and not (tmp_path / "new").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Hugging Face datasets


@pytest.fixture(scope="module")
def hub_style_folder(tmp_path_factory, webvoyager_tasks) -> Path:
    """A folder laid out like a Hub dataset repository: data/<split>-00000-of-00001.parquet."""
    import datasets

    folder = tmp_path_factory.mktemp("hub") / "webvoyager"
    (folder / "data").mkdir(parents=True)
    datasets.Dataset.from_list(webvoyager_tasks[:60]).to_parquet(folder / "data" / "test-00000-of-00001.parquet")
    datasets.Dataset.from_list(webvoyager_tasks[60:90]).to_parquet(folder / "data" / "train-00000-of-00001.parquet")
    return folder


def test_a_dataset_read_with_load_dataset_gives_the_same_rows_as_the_jsonl(
    tmp_path, capsys, no_network, hub_style_folder, webvoyager_tasks
):
    code, stdout, _ = run(
        capsys, "--hf-dataset", hub_style_folder, "--hf-split", "test", "--output-dir", tmp_path / "hf",
        "--cache-dir", tmp_path / "cache", "--reference-answers", ANSWERS_FILE,
    )  # fmt: skip
    assert code == 0, stdout
    assert f"source: {hub_style_folder}[test] (60 records)" in stdout

    local = write_jsonl(tmp_path / "local.jsonl", webvoyager_tasks[:60])
    assert (
        run(capsys, "--input", local, "--output-dir", tmp_path / "jsonl", "--reference-answers", ANSWERS_FILE)[0] == 0
    )
    for name in ("train.jsonl", "val.jsonl"):
        assert read_jsonl(tmp_path / "hf" / name) == read_jsonl(tmp_path / "jsonl" / name)
    assert no_network == []


def test_a_missing_hugging_face_dataset_exits_2_without_touching_the_network(tmp_path, capsys, no_network):
    code, _, stderr = run(
        capsys, "--hf-dataset", tmp_path / "nowhere", "--output-dir", tmp_path / "out", "--cache-dir", tmp_path / "c"
    )
    assert code == 2 and "cannot load the dataset" in stderr and not (tmp_path / "out").exists()


def test_a_saved_dataset_dict_asks_for_a_split_then_reads_it(tmp_path, capsys, no_network, webvoyager_tasks):
    import datasets

    saved = tmp_path / "saved"
    datasets.DatasetDict(
        train=datasets.Dataset.from_list(webvoyager_tasks[:20]),
        test=datasets.Dataset.from_list(webvoyager_tasks[20:30]),
    ).save_to_disk(saved)

    code, _, stderr = run(capsys, "--from-disk", saved, "--output-dir", tmp_path / "out")
    assert code == 2 and "choose a split with --hf-split; the saved dataset has ['test', 'train']" in stderr

    code, stdout, _ = run(capsys, "--from-disk", saved, "--hf-split", "test", "--output-dir", tmp_path / "out")
    assert code == 0 and f"source: {saved}[test] (10 records)" in stdout
    rows = read_jsonl(tmp_path / "out" / "train.jsonl") + read_jsonl(tmp_path / "out" / "val.jsonl")
    assert sorted(row["task_id"] for row in rows) == sorted(t["id"] for t in webvoyager_tasks[20:30])
    assert no_network == []


def test_a_bad_record_in_a_saved_dataset_is_named_by_its_index(tmp_path, capsys, no_network):
    import datasets

    records = [task(0), task(1), task(2, verifier_metadata={"final_url": "https://x.example/"}), task(1)]
    for record in records:
        record.setdefault("verifier_metadata", None)
    datasets.Dataset.from_list(records).save_to_disk(tmp_path / "saved")

    code, _, stderr = run(capsys, "--from-disk", tmp_path / "saved", "--output-dir", tmp_path / "out")

    assert code == 2
    assert f"{tmp_path / 'saved'}#3: duplicate task id 'Allrecipes--1' (first at {tmp_path / 'saved'}#1)" in stderr


# ---------------------------------------------------------------------------------------------------------------------
# The command line itself


def test_help_teaches_the_use_with_examples(capsys):
    with pytest.raises(SystemExit) as exited:
        prep.main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "examples:" in text and "--reference-answers reference_answer.json" in text and "--dry-run" in text


def test_the_script_runs_as_a_file_from_the_recipe_folder(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [task(0), task(1)])
    result = subprocess.run(
        [sys.executable, "prepare_webvoyager_data.py", "--input", str(source), "--output-dir", str(tmp_path / "o")],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "wrote:" in result.stdout

    usage = subprocess.run(
        [sys.executable, "prepare_webvoyager_data.py", "--output-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert usage.returncode == 2 and "one of the arguments --input --hf-dataset --from-disk is required" in usage.stderr


def test_a_missing_input_file_or_a_misplaced_split_exits_2(tmp_path, capsys):
    code, _, stderr = run(capsys, "--input", tmp_path / "absent.jsonl", "--output-dir", tmp_path / "out")
    assert code == 2 and f"{tmp_path / 'absent.jsonl'}: no such file" in stderr

    source = write_jsonl(tmp_path / "in.jsonl", [task(0)])
    code, _, stderr = run(capsys, "--input", source, "--hf-split", "test", "--output-dir", tmp_path / "out")
    assert code == 2 and "--hf-split applies to --hf-dataset and --from-disk only" in stderr
    assert not (tmp_path / "out").exists()
