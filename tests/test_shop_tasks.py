"""The Corner Shop task suite: its files, its preparation like any WebVoyager list, and every task solved (and
failed) by the scripted policy through the recipe's real agent loop against the in-process environment server.

The fake's shop is compared with Chromium's rendering of the real pages in ``test_shop_tasks_integration.py``.
"""

from __future__ import annotations

import collections
import json
import random

import pytest

from nemo_gym_browser import prepare_webvoyager_data as prep
from nemo_gym_browser.browser_agent_loop import close_shared_clients
from nemo_gym_browser.dataset import BrowserJSONLDataset
from nemo_gym_browser.gym_contract.environment import VERIFIER_KEYS, EnvironmentClient
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local import shop_scripts
from nemo_gym_browser.local import shop_tasks as st
from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer
from nemo_gym_browser.local.in_process_loop import build_loop
from nemo_gym_browser.settings import EnvironmentConfig

FAST_ENV = {"call_timeout_s": 5.0, "seed_timeout_s": 5.0, "verify_timeout_s": 5.0, "close_timeout_s": 5.0}


def prepare(task_file, output_dir) -> list[dict]:
    """The rows ``prepare_webvoyager_data.py`` writes for a task file (all of them to train.jsonl)."""
    assert prep.main(["--input", str(task_file), "--val-fraction", "0", "--output-dir", str(output_dir)]) == 0
    lines = (output_dir / prep.TRAIN_FILE).read_text(encoding="utf-8").splitlines()
    assert (output_dir / prep.VAL_FILE).read_text(encoding="utf-8") == ""
    return [json.loads(line) for line in lines]


async def play(script, sample, server, tokenizer, tools, trainer_config):
    """One episode of ``script`` through the recipe's loop against ``server``; an infrastructure failure fails."""
    loop = build_loop(
        sp.ScriptedPolicy(tokenizer, script),
        tokenizer=tokenizer,
        tools=tools,
        trainer_config=trainer_config,
        environment={"server_urls": [server.url], **FAST_ENV},
    )
    output = await loop.run({}, **sample)
    assert output.extra_fields["env_invalid"] is False, output.extra_fields
    return output


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, object]:
    """Both task files prepared and loaded by the recipe's dataset, as a training run reads them."""
    root = tmp_path_factory.mktemp("shop")
    rows = {
        split: prepare(path, root / split)
        for split, path in (("train", st.TRAIN_FILE), ("heldback", st.HELD_BACK_FILE))
    }
    datasets = {split: BrowserJSONLDataset(str(root / split / prep.TRAIN_FILE)) for split in rows}
    return {"rows": rows, "datasets": datasets}


def test_the_committed_pages_and_task_files_are_what_the_catalogue_renders():
    assert st.stale_files() == []
    assert st.main(["--check"]) == 0


def test_the_task_files_prepare_into_rows_that_start_on_the_shop_and_use_every_verifier_key(prepared, capsys):
    rows = prepared["rows"]
    assert (len(rows["train"]), len(rows["heldback"])) == (72, 24)
    for row in rows["train"] + rows["heldback"]:
        assert row["initial_url"].startswith(f"{st.SHOP_ORIGIN}/{st.SHOP_FOLDER}/")
        assert len(row["verifier_metadata"]) == 1 and set(row["verifier_metadata"]) <= set(VERIFIER_KEYS)
        assert row["question"] in row["responses_create_params"]["input"][-1]["content"]
        assert row["task_metadata"]["kind"] in st.KINDS
    used = {key for row in rows["train"] + rows["heldback"] for key in row["verifier_metadata"]}
    assert used == set(VERIFIER_KEYS)
    assert [len(dataset) for dataset in prepared["datasets"].values()] == [72, 24]


def test_held_back_tasks_target_other_items_of_the_same_kinds_and_answer_with_prices_training_has_seen():
    train, held = st.task_records("train"), st.task_records("heldback")
    assert {r["item"] for r in train}.isdisjoint({r["item"] for r in held})
    assert collections.Counter(r["kind"] for r in held) == dict.fromkeys(st.KINDS, 6)
    assert collections.Counter(r["kind"] for r in train) == dict.fromkeys(st.KINDS, 18)
    train_prices = {r["verifier_metadata"]["answer_equals"] for r in train if r["kind"] == "price"}
    assert {r["verifier_metadata"]["answer_equals"] for r in held if r["kind"] == "price"} <= train_prices
    positions = {
        section: [name for name, _ in entries].index(held_item)
        for section, entries in st.CATEGORIES.items()
        for held_item in st.HELD_BACK_ITEMS
        if held_item in dict(entries)
    }
    assert len(positions) == len(st.CATEGORIES) and len(set(positions.values())) > 1


@pytest.mark.parametrize("kind", st.KINDS)
async def test_every_task_is_solved_by_the_scripted_policy_through_the_loop_and_a_wrong_play_scores_zero(
    prepared, kind, tokenizer, tools, trainer_config
):
    records = {record["id"]: record for record in st.task_records()}
    samples = [
        dataset[i]
        for dataset in prepared["datasets"].values()
        for i in range(len(dataset))
        if records[dataset[i]["extra_info"]["task_id"]]["kind"] == kind
    ]
    assert len(samples) == 24
    rewards: dict[bool, list[float]] = {False: [], True: []}
    try:
        async with InProcessEnvironmentServer(site=st.in_process_site()) as server:
            for sample in samples:
                record = records[sample["extra_info"]["task_id"]]
                for wrong in (False, True):
                    chooser = shop_scripts.Chooser.always_wrong() if wrong else shop_scripts.Chooser()
                    script = shop_scripts.script_for(record, chooser, wrong_answer=wrong)
                    output = await play(script, sample, server, tokenizer, tools, trainer_config)
                    assert output.extra_fields["reward_source"] == "verify"
                    if not wrong:
                        assert "error" not in tokenizer.decode(output.response_ids).lower(), record["id"]
                    rewards[wrong].append(output.reward_score)
            assert server.open_sessions == 0
    finally:
        await close_shared_clients()
    assert rewards == {False: [1.0] * 24, True: [0.0] * 24}


async def test_the_fake_search_page_finds_an_item_by_its_name_in_any_case_and_reports_other_queries():
    async def search(client, text: str) -> str:
        home = st.page_url("index.html")
        async with client.session(rollout_id="s", attempt=0, task_id=text or "empty", initial_url=home) as session:
            listed = shop_scripts.elements((await session.observe()).observation)
            box = next(eid for eid, tag, _ in listed if tag == "input")
            submit = next(eid for eid, tag, name in listed if tag == "button" and name == "Search")
            assert (await session.type(box, text)).error is None
            return (await session.click(submit)).observation

    async with InProcessEnvironmentServer(site=st.in_process_site()) as server:
        async with EnvironmentClient(EnvironmentConfig(server_urls=(server.url,), **FAST_ENV)) as client:
            found = await search(client, "MaNgO")
            missing = await search(client, "a kite & a yoyo")
            empty = await search(client, "")
    assert found.startswith(f"URL: {st.page_url('search.html')}?q=MaNgO\nTITLE: Search\n")
    assert shop_scripts.elements(found) == [(0, "a", "Mango"), (1, "a", "Home")]
    assert "Results for: MaNgO Mango Home" in found
    assert f"{st.page_url('search.html')}?q=a+kite+%26+a+yoyo" in missing
    assert "Results for: a kite & a yoyo No items found. Home" in missing
    assert "No query." in empty and shop_scripts.elements(empty) == [(0, "a", "Home")]


def test_a_shuffled_shop_lists_the_same_links_in_a_seeded_other_order():
    plain, shuffled, again = st.in_process_site(), st.in_process_site(order_seed=3), st.in_process_site(order_seed=3)
    for file in ("index.html", "fruit.html", "garden.html"):
        url = st.page_url(file)
        names = [element.name for element in plain.page(url).elements]
        assert sorted(element.name for element in shuffled.page(url).elements) == sorted(names)
        assert shuffled.page(url) == again.page(url)
    orders = {
        tuple(e.name for e in st.in_process_site(order_seed=seed).page(st.page_url("index.html")).elements)
        for seed in range(5)
    }
    assert len(orders) > 1


def test_a_chooser_picks_the_named_element_with_its_probability_and_otherwise_uniformly():
    chooser = shop_scripts.Chooser(0.4, random.Random(7))
    picks = collections.Counter(chooser.pick("Mango", ["Apple", "Banana", "Cherry", "Mango"]) for _ in range(4000))
    assert picks["Mango"] / 4000 == pytest.approx(0.4 + 0.6 / 4, abs=0.03)
    assert all(picks[name] / 4000 == pytest.approx(0.6 / 4, abs=0.03) for name in ("Apple", "Banana", "Cherry"))
    assert shop_scripts.Chooser.always_wrong().pick("Apple", ["Apple", "Banana"]) == "Banana"
    with pytest.raises(ValueError, match="correct must be in"):
        shop_scripts.Chooser(1.5)


def test_the_command_line_explains_itself_and_refuses_no_action(capsys):
    with pytest.raises(SystemExit) as raised:
        st.main(["--help"])
    assert raised.value.code == 0
    assert "prepare_webvoyager_data.py --input examples/shop_tasks_train.jsonl" in capsys.readouterr().out
    with pytest.raises(SystemExit) as raised:
        st.main([])
    assert raised.value.code == 2


# ----- the deal suite -------------------------------------------------------------------------------------------


def test_deal_boards_mark_one_fruit_each_and_every_fruit_is_on_sale_equally_often_in_each_split(tmp_path):
    names = st.deal_names()
    for split, per_fruit in st.DEAL_TASKS_PER_FRUIT.items():
        records = st.task_records(split, suite="deal")
        on_sale = collections.Counter(record["verifier_metadata"]["answer_equals"] for record in records)
        assert on_sale == dict.fromkeys(names, per_fruit)  # a guess is right one time in four
    site = st.in_process_site()
    orders = set()
    for board in st.deal_boards()[:200]:
        page = site.page(st.page_url(board.file))
        labels = [element.name for element in page.elements]
        assert labels == [*(board.label(name) for name in board.order), "Home"]
        assert sum(label.endswith(st.SALE_MARK) for label in labels) == 1
        orders.add(board.order)
    assert len(orders) == 24  # every order of the four fruit occurs
    assert site.page(st.page_url("deals.html?board=x")).text.splitlines()[1] == "No such board."
    rows = prepare(st.DEAL_HELD_BACK_FILE, tmp_path)
    assert {row["question"] for row in rows} == {st.DEAL_QUESTION}
    assert all(set(row["verifier_metadata"]) == {"answer_equals"} for row in rows)


@pytest.mark.parametrize("route", ["browse", "guess"])
async def test_a_deal_is_answered_by_reading_the_board_or_from_memory_without_touching_the_browser(
    route, tokenizer, tools, trainer_config, tmp_path
):
    rows = prepare(st.DEAL_TRAIN_FILE, tmp_path)[:24]
    dataset = BrowserJSONLDataset(str(tmp_path / prep.TRAIN_FILE))
    records = st.records_by_id()
    rewards = []
    try:
        async with InProcessEnvironmentServer(site=st.in_process_site()) as server:
            for i in range(len(rows)):
                sample = dataset[i]
                record = records[sample["extra_info"]["task_id"]]
                chooser = shop_scripts.Chooser(1.0, random.Random(i))
                script = shop_scripts.deal_script(record, chooser, guess=1.0 if route == "guess" else 0.0)
                output = await play(script, sample, server, tokenizer, tools, trainer_config)
                assert output.extra_fields["env_browser_actions"] == (1 if route == "browse" else 0)
                rewards.append(output.reward_score)
            assert server.open_sessions == 0
    finally:
        await close_shared_clients()
    if route == "browse":
        assert rewards == [1.0] * len(rows)  # the solver reads the mark every time
    else:
        assert 0 < sum(rewards) < len(rows)  # a fruit drawn at random: right on some boards, wrong on most


# ----- the aisle suite ------------------------------------------------------------------------------------------


def test_aisle_days_balance_the_answer_per_split_and_only_the_marked_aisle_has_it():
    names = st.deal_names()
    for split, per_fruit in st.AISLE_TASKS_PER_FRUIT.items():
        records = st.task_records(split, suite="aisle")
        answers = collections.Counter(record["verifier_metadata"]["answer_equals"] for record in records)
        assert answers == dict.fromkeys(names, per_fruit)  # a guess is right one time in four
        assert {record["ques"] for record in records} == {st.AISLE_QUESTION}
    days = st.aisle_days()
    # the answer is not told by the marked aisle's name or place, nor by the day number's last digit
    assert {(day.deal_aisle, day.sale) for day in days} == {(aisle, name) for aisle in st.AISLES for name in names}
    assert {(day.order.index(day.deal_aisle), day.sale) for day in days} == {(i, n) for i in range(4) for n in names}
    assert {(day.number % 10, day.sale) for day in days if day.split == "train"} >= {
        (digit, name) for digit in (0, 1, 2, 3, 5, 6, 7, 8) for name in names
    }
    for day in days[:100]:
        assert sorted(day.sales.values()) == sorted(names)  # any other aisle's stand has another fruit on sale


def test_the_splits_share_the_url_shape_but_no_day_and_no_training_page_shows_a_held_back_day():
    by_split = {split: st.task_records(split, suite="aisle") for split in ("train", "heldback")}
    numbers = {split: {int(r["web"].rpartition("=")[2]) for r in records} for split, records in by_split.items()}
    assert not numbers["train"] & numbers["heldback"]
    assert {r["web"].rpartition("=")[0] for records in by_split.values() for r in records} == {
        st.page_url(st.AISLES_PAGE + "?day")
    }
    assert all(n % st.AISLE_HELD_BACK_EVERY == st.AISLE_HELD_BACK_EVERY - 1 for n in numbers["heldback"])
    site = st.in_process_site()
    for day in st.aisle_days()[:40]:
        start = site.page(st.page_url(day.file))
        for element in start.elements[:-1]:  # each aisle's stand belongs to the same day
            assert element.href.startswith(f"{st.AISLE_PAGE}?day={day.number}&")


def test_the_aisles_page_marks_one_aisle_and_its_stand_is_a_deal_board_marking_the_answer():
    site = st.in_process_site()
    orders = set()
    for day in st.aisle_days()[:200]:
        start = site.page(st.page_url(day.file))
        labels = [element.name for element in start.elements]
        assert labels == [*(day.label(aisle) for aisle in day.order), "Home"]
        assert [label for label in labels if label.endswith(st.DEAL_MARK)] == [f"{day.deal_aisle} {st.DEAL_MARK}"]
        orders.add(day.order)
        for aisle in st.AISLES:
            stand = site.page(st.page_url(day.stand_file(aisle)))
            marked = [e.name for e in stand.elements if e.name.endswith(st.SALE_MARK)]
            assert stand.title == "Deals" and marked == [f"{day.sales[aisle]} {st.SALE_MARK}"]
    assert len(orders) == 24
    assert site.page(st.page_url("aisles.html?day=x")).text.splitlines()[1] == "No such day."
    for bad in ("aisle.html?day=3&aisle=fruit", "aisle.html?day=&aisle=toys", "aisle.html?day=3"):
        assert site.page(st.page_url(bad)).text.splitlines()[1] == "No such aisle."


class WrongAisle(shop_scripts.Chooser):
    """Clicks an aisle that is not the marked one, then reads that stand's mark correctly."""

    def pick(self, named, plausible):
        return next(name for name in plausible if name != named) if named in st.AISLES else named


@pytest.mark.parametrize("stepwise", [False, True], ids=["trajectory", "stepwise"])
@pytest.mark.parametrize("route", ["browse", "wrong-aisle", "guess"])
async def test_an_aisle_task_is_solved_by_two_dependent_browser_calls_and_not_by_another_aisle_or_a_guess(
    route, stepwise, tokenizer, tools, stepwise_trainer_config, tmp_path
):
    rows = prepare(st.AISLE_TRAIN_FILE, tmp_path)[:16]
    dataset = BrowserJSONLDataset(str(tmp_path / prep.TRAIN_FILE))
    records = st.records_by_id()
    rewards, calls = [], []
    try:
        async with InProcessEnvironmentServer(site=st.in_process_site()) as server:
            for i in range(len(rows)):
                sample = dataset[i]
                record = records[sample["extra_info"]["task_id"]]
                chooser = (WrongAisle if route == "wrong-aisle" else shop_scripts.Chooser)(1.0, random.Random(i))
                script = shop_scripts.aisle_script(record, chooser, guess=1.0 if route == "guess" else 0.0)
                loop = build_loop(
                    sp.ScriptedPolicy(tokenizer, script),
                    tokenizer=tokenizer,
                    tools=tools,
                    trainer_config=stepwise_trainer_config,
                    environment={"server_urls": [server.url], **FAST_ENV},
                    stepwise={"enabled": stepwise},
                )
                v1 = {"uid": f"u{i}", "session_id": 0, "global_steps": 1} if stepwise else {}
                output = await loop.run({}, **sample, **v1)
                final = output[-1] if stepwise else output
                assert final.extra_fields["env_invalid"] is False, final.extra_fields
                assert not stepwise or len(output) == (1 if route == "guess" else 3)
                rewards.append(final.reward_score)
                calls.append(final.extra_fields["env_browser_actions"])
            assert server.open_sessions == 0
    finally:
        await close_shared_clients()
    if route == "browse":
        assert rewards == [1.0] * len(rows) and calls == [2] * len(rows)  # observe, then click the marked aisle
    elif route == "wrong-aisle":
        assert rewards == [0.0] * len(rows) and calls == [2] * len(rows)  # another aisle's stand: another fruit
    else:
        assert calls == [0] * len(rows) and 0 < sum(rewards) < len(rows)
