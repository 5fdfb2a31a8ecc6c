"""The Corner Shop's scripted player: the demonstrations that solve its tasks, or act in the right format and pick
wrongly some of the time.

:func:`script_for` (lookup tasks), :func:`deal_script` (deal tasks) and :func:`aisle_script` (aisle tasks) turn a
task record of :mod:`.shop_tasks` into a :mod:`~nemo_gym_browser.local.scripted_policy` script that reads each
observation it is shown and writes the recipe's ``browser`` tool calls (:func:`call`); a :class:`Chooser` decides
how often it picks the element the task names. Deterministic for a given ``Chooser`` rng and sequence of observations.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..gym_contract.browser_calls import SINGLE_TOOL_NAME
from . import scripted_policy as sp
from .shop_tasks import AISLES, CATEGORIES, DEAL_MARK, HELD_BACK_ITEMS, SALE_MARK, SEARCH_LABEL, deal_names, items

# The answer the demonstrations give when the task asks for no value; graders of those kinds ignore it.
DONE_ANSWER = "done"
# An element id no shop page has: what a script clicks when the element it wants is not on the page.
MISSING_ELEMENT_ID = 99

_ELEMENT = re.compile(r"^\s*\[(\d+)\]\s*([^:]*):\s*(.*)$")


def call(action: str, **arguments: Any) -> str:
    """One call of the recipe's ``browser`` tool as the shop's demonstrations write it.

    The arguments are compact JSON, and a price is answered with the space it has on the page (the grader strips
    the answer), so that what a demonstration copies from the context is the very token it finds there: the id
    ``3`` of ``[3] a: Mango``, the word ``mango`` of ``for "mango"``, the ``" 4"`` of ``Mango: 4 coins.``.
    """
    return sp.tool_call(SINGLE_TOOL_NAME, json.dumps({"action": action, **arguments}, separators=(",", ":")))


def elements(observation: str | None) -> list[tuple[int, str, str]]:
    """``(id, tag, name)`` of every element line of an observation."""
    found = []
    for line in (observation or "").splitlines():
        match = _ELEMENT.match(line)
        if match:
            found.append((int(match.group(1)), match.group(2).strip(), match.group(3).strip()))
    return found


def read_price(observation: str | None) -> str | None:
    """The price an item page states (``Mango: 4 coins.``), as the digits a ``price`` task expects."""
    text = (observation or "").partition("\nTEXT:\n")[2]
    match = re.search(r"\b\w+: (\d+) coins\.", text)
    return match.group(1) if match else None


class Chooser:
    """How a demonstration picks among the plausible elements: the one the task names with probability
    ``correct``, else one drawn uniformly from all plausible ones (the named one included).

    ``correct=1.0`` is the solver; lower values give demonstrations that act in the right format but choose the
    right element only sometimes. Deterministic for a given ``rng`` and sequence of calls.
    """

    def __init__(self, correct: float = 1.0, rng: random.Random | None = None, *, never_named: bool = False) -> None:
        if not 0.0 <= correct <= 1.0:
            raise ValueError(f"correct must be in [0, 1], got {correct}")
        self.correct = correct
        self.rng = rng if rng is not None else random.Random(0)
        self.never_named = never_named

    @classmethod
    def always_wrong(cls) -> Chooser:
        """Picks the first plausible element that is not the named one (for tests of what a wrong play scores)."""
        return cls(0.0, never_named=True)

    def pick(self, named: str, plausible: Sequence[str]) -> str:
        if self.never_named:
            return next(name for name in plausible if name != named)
        if self.correct >= 1.0 or self.rng.random() < self.correct:
            return named
        return self.rng.choice(list(plausible))


_SECTIONS = frozenset(CATEGORIES)
_ITEM_NAMES = frozenset(item.name for item in items())


def _click_named(named: str, chooser: Chooser) -> sp.Step:
    def step(view: sp.PolicyView) -> str:
        listed = elements(view.last_observation)
        plausible = [name for _, tag, name in listed if tag == "a" and name in (_SECTIONS | _ITEM_NAMES)]
        if named in plausible:
            choice = chooser.pick(named, plausible)
        else:  # off the named path after an earlier wrong pick: any plausible element, as a guess would be
            choice = chooser.rng.choice(plausible) if plausible else named
        ids = [eid for eid, tag, name in listed if tag == "a" and name == choice]
        return call("click", element_id=ids[0] if ids else MISSING_ELEMENT_ID)

    return step


def _type_query(query: str, chooser: Chooser, others: Sequence[str]) -> sp.Step:
    def step(view: sp.PolicyView) -> str:
        inputs = [eid for eid, tag, _ in elements(view.last_observation) if tag == "input"]
        text = chooser.pick(query, [query, *others])
        return call("type", element_id=inputs[0] if inputs else MISSING_ELEMENT_ID, text=text)

    return step


def _click_search(view: sp.PolicyView) -> str:
    ids = [eid for eid, tag, name in elements(view.last_observation) if tag == "button" and name == SEARCH_LABEL]
    return call("click", element_id=ids[0] if ids else MISSING_ELEMENT_ID)


def _finish_with_price(view: sp.PolicyView) -> str:
    price = read_price(view.last_observation)
    return call("finish", answer=f" {price}" if price else DONE_ANSWER)


def _answer(name: str) -> str:
    # With the space the name has on the page, so that the answer copies the very token the observation shows.
    return call("finish", answer=f" {name}")


def _finish_with_sale(chooser: Chooser) -> sp.Step:
    def step(view: sp.PolicyView) -> str:
        names = [name for _, tag, name in elements(view.last_observation) if tag == "a"]
        marked = [name.removesuffix(SALE_MARK).strip() for name in names if name.endswith(SALE_MARK)]
        plausible = deal_names()
        return _answer(chooser.pick(marked[0], plausible) if marked else chooser.rng.choice(plausible))

    return step


def _click_marked_aisle(chooser: Chooser) -> sp.Step:
    def step(view: sp.PolicyView) -> str:
        listed = [(eid, name) for eid, tag, name in elements(view.last_observation) if tag == "a"]
        aisles = {name.removesuffix(DEAL_MARK).strip(): eid for eid, name in listed if name != "Home"}
        marked = [name.removesuffix(DEAL_MARK).strip() for _, name in listed if name.endswith(DEAL_MARK)]
        plausible = [aisle for aisle in AISLES if aisle in aisles]
        if not plausible:
            return call("click", element_id=MISSING_ELEMENT_ID)
        choice = chooser.pick(marked[0], plausible) if marked else chooser.rng.choice(plausible)
        return call("click", element_id=aisles[choice])

    return step


def deal_script(record: Mapping[str, Any], chooser: Chooser, guess: float) -> sp.Script:
    """A deal task's play: with probability ``guess`` answer at once from memory (a fruit drawn uniformly: right one
    time in four), never touching the browser; otherwise observe the board and answer with the fruit ``chooser``
    picks (the marked one with its probability ``correct``, else one drawn uniformly, the marked one included)."""
    if chooser.rng.random() < guess:
        return sp.steps(sp.say(_answer(chooser.rng.choice(deal_names()))))
    return sp.steps(sp.say(call("observe")), _finish_with_sale(chooser))


def aisle_script(record: Mapping[str, Any], chooser: Chooser, guess: float) -> sp.Script:
    """An aisle task's play: with probability ``guess`` answer at once from memory (right one time in four), never
    touching the browser; otherwise observe the aisles, click the one ``chooser`` picks (the marked one with its
    probability ``correct``, else one drawn uniformly) and answer with the fruit its stand marks on sale (picked
    the same way)."""
    if chooser.rng.random() < guess:
        return sp.steps(sp.say(_answer(chooser.rng.choice(deal_names()))))
    return sp.steps(sp.say(call("observe")), _click_marked_aisle(chooser), _finish_with_sale(chooser))


def script_for(record: Mapping[str, Any], chooser: Chooser | None = None, *, wrong_answer: bool = False) -> sp.Script:
    """The scripted policy's play for one task record: the shortest solution when ``chooser`` always picks the
    named element; ``wrong_answer`` finishes a ``price`` task with a price that is not the item's."""
    chooser = chooser if chooser is not None else Chooser()
    if record["kind"] == "deal":
        return deal_script(record, chooser, guess=0.0)
    if record["kind"] == "aisle":
        return aisle_script(record, chooser, guess=0.0)
    kind, item = record["kind"], next(entry for entry in items() if entry.name == record["item"])
    finish: sp.Step = sp.say(call("finish", answer=DONE_ANSWER))
    if kind == "open":
        plan = [_click_named(item.name, chooser)]
    elif kind in ("browse", "price"):
        plan = [_click_named(item.section, chooser), _click_named(item.name, chooser)]
        if kind == "price":
            finish = sp.say(call("finish", answer=f" {item.price % 9 + 1}")) if wrong_answer else _finish_with_price
    elif kind == "search":
        others = sorted(entry.slug for entry in items() if entry.name not in HELD_BACK_ITEMS and entry != item)
        plan = [_type_query(item.slug, chooser, others), _click_search]
    else:
        raise ValueError(f"unknown task kind {kind!r}")
    return sp.steps(sp.say(call("observe")), *plan, finish)
