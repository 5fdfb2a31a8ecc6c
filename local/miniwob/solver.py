"""A scripted MiniWoB++ player that reads only what the policy reads: the observations the recipe's tool returns.

What it is
    For each task it solves (:data:`SOLVERS`), a plan written as a generator: it is given the first observation,
    yields one call of the recipe's ``browser`` tool at a time (``{"action": "click", "element_id": 3}``) and is
    sent the observation each call returned. Nothing else reaches it: not the page's scripts, not MiniWoB's answer,
    not the row. Task names come from the observed URL.

    :func:`next_call` replays a plan over the observations of an episode so far and returns the next call (a plan
    is deterministic, so replaying it is the same as running it); :func:`script` is that, as a
    :mod:`~nemo_gym_browser.local.scripted_policy` script the recipe's loop plays like a model.

What it knows besides the page
    What a reader brings: arithmetic, the order of months, 12-hour clock times, and the row labels of the tables
    MiniWoB draws (:data:`TABLE_LABELS`, shown on the page). It knows no word lists (so no solver for
    click-checkboxes-soft).
"""

from __future__ import annotations

import calendar
import json
import re
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from ...gym_contract.browser_calls import SINGLE_TOOL_NAME

Call = dict[str, Any]
Plan = Generator[Call, "Page", None]

# A plan that has not finished after this many calls finishes anyway (none needs more than about 30).
MAX_CALLS = 60
EPISODE_OVER = "Episode over."
ANSWER = "done"
MONTHS = tuple(calendar.month_name)[1:]  # English in the C locale, as the date picker writes them
# The row labels of read-table's and read-table-2's tables, as the pages show them (longest first for matching).
TABLE_LABELS = ("Year of Birth", "First name", "Last name", "Language", "Religion", "Country", "Gender", "Color")

_ELEMENT = re.compile(r"^\s*\[(\d+)\]\s*([^:]*):\s?(.*)$")
_TASK_URL = re.compile(r"/miniwob/([a-z0-9-]+)\.html")


class PlanFailed(Exception):
    """The page does not look the way the plan expects; the plan finishes instead of guessing."""


@dataclass(frozen=True)
class Element:
    id: int
    tag: str
    name: str


@dataclass(frozen=True)
class Page:
    """One observation as the policy reads it (``URL:``, ``TITLE:``, ``ELEMENTS:``, ``TEXT:``), or an error."""

    raw: str
    url: str = ""
    title: str = ""
    elements: tuple[Element, ...] = ()
    text: str = ""
    error: str | None = None

    @classmethod
    def parse(cls, observation: str) -> Page:
        error = None
        if observation.startswith("Error:"):
            first, _, rest = observation.partition("\n")
            error, observation = first.removeprefix("Error:").strip(), rest
        url = title = text = ""
        elements: list[Element] = []
        lines = observation.splitlines()
        for index, line in enumerate(lines):
            if line.startswith("URL: "):
                url = line[5:].strip()
            elif line.startswith("TITLE: "):
                title = line[7:].strip()
            elif line.startswith("TEXT:"):
                text = " ".join(part.strip() for part in lines[index + 1 :] if part.strip() != "... (truncated)")
                break
            else:
                match = _ELEMENT.match(line)
                if match:
                    elements.append(Element(int(match.group(1)), match.group(2).strip(), match.group(3).strip()))
        return cls(raw=observation, url=url, title=title, elements=tuple(elements), text=text.strip(), error=error)

    @property
    def task(self) -> str | None:
        match = _TASK_URL.search(self.url)
        return match.group(1) if match else None

    @property
    def over(self) -> bool:
        return EPISODE_OVER in self.text

    def all(self, tag: str | None = None, name: str | None = None) -> list[Element]:
        return [e for e in self.elements if (tag is None or e.tag == tag) and (name is None or e.name == name)]

    def one(self, tag: str | None = None, name: str | None = None, index: int = 0) -> Element:
        found = self.all(tag, name)
        if len(found) <= index:
            raise PlanFailed(f"no {tag or 'element'} {name!r} (#{index}) on the page")
        return found[index]

    def find(self, pattern: str) -> re.Match[str]:
        match = re.search(pattern, self.text)
        if match is None:
            raise PlanFailed(f"the page text does not match {pattern!r}")
        return match

    def between(self, start: str, end: str) -> str:
        """The page text after the first ``start`` and before the last ``end``."""
        _, found, tail = self.text.partition(start)
        if not found:
            raise PlanFailed(f"{start!r} is not in the page text")
        body, found, _ = tail.rpartition(end)
        if not found:
            raise PlanFailed(f"{end!r} is not after {start!r}")
        return body.strip()


# ----- the calls ------------------------------------------------------------------------------------------------


def observe() -> Call:
    return {"action": "observe"}


def click(element: Element) -> Call:
    return {"action": "click", "element_id": element.id}


def fill(element: Element, text: str) -> Call:
    return {"action": "type", "element_id": element.id, "text": text}


def finish() -> Call:
    return {"action": "finish", "answer": ANSWER}


# ----- helpers ---------------------------------------------------------------------------------------------------


def ordinal(word: str) -> int:
    """``1st`` -> 1, ``2nd`` -> 2, ``10th`` -> 10."""
    match = re.fullmatch(r"(\d+)(?:st|nd|rd|th)", word)
    if match is None:
        raise PlanFailed(f"{word!r} is not an ordinal")
    return int(match.group(1))


def labelled_inputs(page: Page, labels_text: str) -> list[tuple[Element, str]]:
    """Checkboxes or radio buttons with their labels: the inputs are listed without names, and the labels, one
    word each, follow in the page text in the same order."""
    inputs, labels = page.all("input"), labels_text.split()
    if len(inputs) != len(labels):
        raise PlanFailed(f"{len(inputs)} inputs but {len(labels)} labels")
    return list(zip(inputs, labels, strict=True))


# ----- the plans --------------------------------------------------------------------------------------------------


def click_named_button(pattern: str) -> Callable[[Page], Plan]:
    def plan(page: Page) -> Plan:
        name = page.find(pattern).group(1)
        yield click(page.one("button", name))

    return plan


def click_button_sequence(page: Page) -> Plan:
    first, second = page.find(r"Click button (\w+), then click button (\w+)\.").groups()
    page = yield click(page.one("button", first))
    yield click(page.one("button", second))


def click_checkboxes(page: Page) -> Plan:
    wanted = page.find(r"^Select (.*?) and click Submit\.").group(1)
    names = set() if wanted == "nothing" else set(wanted.split(", "))
    boxes = labelled_inputs(page, page.between("and click Submit.", "Submit"))
    for box, label in boxes:
        if label in names:
            page = yield click(box)
    yield click(page.one("button", "Submit"))


def click_option(page: Page) -> Plan:
    wanted = page.find(r"^Select (.*?) and click Submit\.").group(1)
    radios = labelled_inputs(page, page.between("and click Submit.", "Submit"))
    page = yield click(next(radio for radio, label in radios if label == wanted))
    yield click(page.one("button", "Submit"))


def click_dialog(page: Page) -> Plan:
    yield click(page.one("button", "Close"))


def click_dialog_2(page: Page) -> Plan:
    label = page.find(r'labeled "(.+?)"\.').group(1)
    yield click(page.one("button", "Close" if label == "x" else label))


def click_tab(page: Page) -> Plan:
    number = page.find(r"Click on Tab #(\d+)\.").group(1)
    yield click(page.one("a", f"Tab #{number}"))


def fill_and_submit(pattern: str, transform: Callable[[re.Match[str]], str] = lambda m: m.group(1)):
    def plan(page: Page) -> Plan:
        text = transform(page.find(pattern))
        page = yield fill(page.one("input"), text)
        yield click(page.one("button", "Submit"))

    return plan


def enter_text_2(page: Page) -> Plan:
    text, case = page.find(r'Type "(.+?)" in all (upper|lower) case letters').groups()
    page = yield fill(page.one("input"), text.upper() if case == "upper" else text.lower())
    yield click(page.one("button", "Submit"))


def enter_password(page: Page) -> Plan:
    password = page.find(r'Enter the password "(.+?)" into both').group(1)
    page = yield fill(page.one("input", index=0), password)
    page = yield fill(page.one("input", index=1), password)
    yield click(page.one("button", "Submit"))


def _date(match: re.Match[str]) -> str:
    month, day, year = match.group(1).split("/")
    return f"{year}-{month}-{day}"


def _time(match: re.Match[str]) -> str:
    hours, minutes, half = int(match.group(1)), match.group(2), match.group(3)
    hours = hours % 12 + (12 if half == "PM" else 0)
    return f"{hours:02d}:{minutes}"


def find_word(page: Page) -> Plan:
    position = ordinal(page.find(r"Find the (\w+) word in the paragraph").group(1))
    words = page.between('press "Submit".', "Submit").split()
    if position > len(words):
        raise PlanFailed(f"the paragraph has {len(words)} words")
    page = yield fill(page.one("input"), re.sub(r"[^A-Za-z]", "", words[position - 1]))
    yield click(page.one("button", "Submit"))


def focus_text(page: Page) -> Plan:
    yield click(page.one("input"))


def focus_text_2(page: Page) -> Plan:
    position = ordinal(page.find(r"Focus into the (\w+) input textbox").group(1))
    yield click(page.one("input", index=position - 1))


def form_sequence_2(page: Page) -> Plan:
    asked = page.find(r'Check the (\w+) radio button and enter the number "(-?\d+)" into the (\w+)')
    radio, number, box = asked.groups()
    page = yield click(page.one("input", str(ordinal(radio))))
    text_boxes = [element for element in page.all("input") if element.name == ""]
    page = yield fill(text_boxes[ordinal(box) - 1], number)
    yield click(page.one("button", "Submit"))


def generate_number(page: Page) -> Plan:
    query = page.find(r"^Generate (.*?), then press submit\.").group(1)
    rules: dict[str, Callable[[int], bool]] = {
        "an odd number": lambda n: n % 2 == 1,
        "an even number": lambda n: n % 2 == 0,
    }
    less = re.fullmatch(r"a number less than (\d+)", query)
    greater = re.fullmatch(r"a number greater than (\d+)", query)
    if less:
        rules[query] = lambda n: n < int(less.group(1))
    if greater:
        rules[query] = lambda n: n > int(greater.group(1))
    if query not in rules:
        raise PlanFailed(f"unknown rule {query!r}")
    for _ in range(MAX_CALLS // 2 - 2):
        page = yield click(page.one("button", "Generate"))
        shown = page.find(r"press submit\. (-?\d+) Generate").group(1)
        if rules[query](int(shown)):
            break
    yield click(page.one("button", "Submit"))


def guess_number(page: Page) -> Plan:
    low, high = 0, 9
    while low <= high:
        guess = (low + high) // 2
        page = yield fill(page.one("input"), str(guess))
        page = yield click(page.one("button", "Submit"))
        if page.over or "Correct!" in page.text:
            return
        if f"The number is higher than {guess}." in page.text:
            low = guess + 1
        elif f"The number is lower than {guess}." in page.text:
            high = guess - 1
        else:
            raise PlanFailed("no feedback after a guess")


def login_user(button: str) -> Callable[[Page], Plan]:
    def plan(page: Page) -> Plan:
        user, password = page.find(r'username "(.+?)" and the password "(.+?)"').groups()
        for index, text in enumerate((user, password)):
            page = yield fill(page.one("input", index=index), text)
            if "Exit to home page?" in page.text:  # a popup disabled the form: dismiss it, fill again
                page = yield click(page.one("button", "Cancel"))
                page = yield fill(page.one("input", index=index), text)
        yield click(page.one("button", button))

    return plan


def odd_or_even(page: Page) -> Plan:
    numbers = [int(n) for n in re.findall(r"Odd (-?\d+) Even", page.text)]
    for row, number in enumerate(numbers):
        page = yield click(page.one("button", "Odd" if number % 2 else "Even", index=row))
    yield click(page.one("button", "Submit"))


def phone_book(page: Page) -> Plan:
    person, wanted = page.find(r"^Find (.+?) in the contact book and click on their (.+?)\.").groups()
    fields = ("phone", "email", "address")  # the contact's links, in this order
    if not wanted.startswith(fields):
        raise PlanFailed(f"unknown contact field {wanted!r}")
    for _ in range(6):
        shown = page.find(r"click on their .+?\. (.+?) Phone:").group(1)
        if shown == person:
            links = page.all("a")
            yield click(links[next(i for i, name in enumerate(fields) if wanted.startswith(name))])
            return
        page = yield click(page.one("a", ">"))
    raise PlanFailed(f"{person} is in none of the pages")


def _table_value(table: str, label: str) -> str:
    labels = "|".join(re.escape(name) for name in TABLE_LABELS)
    match = re.search(rf"(?:^| ){re.escape(label)} (.+?)(?= (?:{labels}) |$)", table)
    if match is None:
        raise PlanFailed(f"no {label!r} row in the table")
    return match.group(1)


def read_table(page: Page) -> Plan:
    label = page.find(r"Enter the value of (.+?) into the text field").group(1)
    table = page.between("and press Submit.", "Submit")
    page = yield fill(page.one("input"), _table_value(table, label))
    yield click(page.one("button", "Submit"))


def read_table_2(page: Page) -> Plan:
    rest = page.between("submit when done.", "Submit")
    labels = "|".join(re.escape(name) for name in TABLE_LABELS)
    form = re.search(rf"((?:{labels}):) ((?:{labels}):)$", rest)
    if form is None:
        raise PlanFailed("no form labels after the table")
    table = rest[: form.start()].strip()
    for index, label in enumerate((form.group(1), form.group(2))):
        page = yield fill(page.one("input", index=index), _table_value(table, label.removesuffix(":")))
    yield click(page.one("button", "Submit"))


def search_engine(page: Page) -> Plan:
    asked = page.find(r'enter "(.+?)" and press "Search", then find and click the (\w+) search result')
    query, position = asked.groups()
    number = ordinal(position)
    page = yield fill(page.one("input"), query)
    page = yield click(page.one("button", "Search"))
    result_page = (number - 1) // 3 + 1
    if result_page > 1:
        page = yield click(page.one("a", str(result_page)))
    results = [element for element in page.all("a") if element.name not in {"<", ">", "«", "»", "1", "2", "3"}]
    if len(results) != 3:
        raise PlanFailed(f"{len(results)} results on the page")
    yield click(results[(number - 1) % 3])


def _algebra(match: re.Match[str]) -> str:
    left, op, right, total = match.groups()
    total_ = int(total)
    if left == "x":
        return str(total_ - int(right) if op == "+" else total_ + int(right))
    return str(total_ - int(left) if op == "+" else int(left) - total_)


def _arithmetic(match: re.Match[str]) -> str:
    one, op, two = int(match.group(1)), match.group(2), int(match.group(3))
    return str({"+": one + two, "-": one - two, "x": one * two}[op])


def text_transform(page: Page) -> Plan:
    text = page.between("press Submit.", "Submit").replace(" ", "")
    page = yield fill(page.one("input"), text)
    yield click(page.one("button", "Submit"))


def use_autocomplete(page: Page) -> Plan:
    # Once a suggestion menu opens it covers Submit, and no tool closes it (no Escape key, no click outside it on a
    # listed element): fill a text that starts and ends as asked but that no suggestion starts with.
    start, end = page.find(r'starts with "(.+?)"(?: and ends with "(.+?)")?\.').groups(default="")
    page = yield fill(page.one("input"), f"{start}-{end}")
    yield click(page.one("button", "Submit"))


def buy_ticket(page: Page) -> Plan:
    goal = page.find(r"Buy the ticket with the (.+?)\.").group(1)
    rows = re.findall(r"Duration: (\d+)h (\d+)m Book for \$(\d+)", page.text)
    buttons = [element for element in page.all("button") if element.name.startswith("Book for $")]
    if not rows or len(rows) != len(buttons):
        raise PlanFailed("the flights and their buttons do not pair up")
    minutes = [int(h) * 60 + int(m) for h, m, _ in rows]
    prices = [int(price) for _, _, price in rows]
    keys = {
        "cheapest cost": (prices, min),
        "most expensive cost": (prices, max),
        "shortest duration": (minutes, min),
        "longest duration": (minutes, max),
    }
    values, pick = keys[goal]
    yield click(buttons[values.index(pick(values))])


def _pick_date(page: Page, field_: Element, date: str) -> Generator[Call, Page, Page]:
    """Open the jQuery UI date picker of ``field_``, page to the month of ``date`` (mm/dd/yyyy), click its day."""
    month, day, year = (int(part) for part in date.split("/"))
    page = yield click(field_)
    for _ in range(MAX_CALLS // 2):
        shown = re.search(rf"({'|'.join(MONTHS)}) (\d{{4}})", page.text)
        if shown is None:
            raise PlanFailed("the date picker is not open")
        at = (int(shown.group(2)), MONTHS.index(shown.group(1)) + 1)
        if at == (year, month):
            break
        page = yield click(page.one("a", "Prev" if at > (year, month) else "Next"))
    return (yield click(page.one("a", str(day))))


def choose_date(page: Page) -> Plan:
    date = page.find(r"Select (\d+/\d+/\d+) as the date").group(1)
    page = yield from _pick_date(page, page.one("input"), date)
    yield click(page.one("button", "Submit"))


# jQuery UI autocomplete's live-region text while its suggestion menu is open ("1 result is available, ...").
_SUGGESTIONS = re.compile(r"(\d+) results? (?:is|are) available, use up and down arrow keys to navigate\.")
_AIRPORT = re.compile(r"\s*(.+?) \(([A-Z]{3})\)")
# Observations to wait through for a delayed suggestion menu (jQuery UI searches 300 ms after the last input).
MENU_WAIT_OBSERVATIONS = 6


def _suggestions(page: Page) -> list[str]:
    """The items of the open suggestion menus: the airports the page text lists after the Search button (a menu
    is followed by its live-region message; a closed menu's message stays, its items do not)."""
    listed = page.text.partition(" Search ")[2]
    if not _SUGGESTIONS.search(listed):
        return []
    chunks = _SUGGESTIONS.split(listed)[::2]  # split() interleaves the captured counts
    return [f"{name} ({code})" for chunk in chunks for name, code in _AIRPORT.findall(chunk)]


def _pick_airport(page: Page, index: int, wanted: str) -> Generator[Call, Page, tuple[Page, str]]:
    """Fill input ``index`` with ``wanted`` (a city or an airport code), then with the suggestion it names, and wait
    until the menu shows that suggestion alone (its search has run, so filling it again searches nothing)."""
    page = yield fill(page.one("input", index=index), wanted)
    for _ in range(MENU_WAIT_OBSERVATIONS):
        named = [item for item in _suggestions(page) if wanted in (item[-4:-1], item.rpartition(" (")[0])]
        if named:
            break
        page = yield observe()
    else:
        raise PlanFailed(f"no suggestion names {wanted!r}")
    page = yield fill(page.one("input", index=index), named[0])
    for _ in range(MENU_WAIT_OBSERVATIONS):
        if _suggestions(page) == [named[0]]:
            break
        page = yield observe()
    return page, named[0]


def book_flight(page: Page) -> Plan:
    goal, origin, destination, date = page.find(
        r"Book the (cheapest|shortest) one-way flight from: (.+?) to: (.+?) on (\d+/\d+/\d+)\."
    ).groups()
    # The date first: a suggestion menu, once open, covers the date field.
    page = yield from _pick_date(page, page.one("input", index=2), date)
    page, chosen = yield from _pick_airport(page, 0, origin)
    page, _ = yield from _pick_airport(page, 1, destination)
    # Back to the first field with the same text: the second field's menu closes and no new search opens one.
    page = yield fill(page.one("input", index=0), chosen)
    page = yield click(page.one("button", "Search"))
    rows = re.findall(r"Duration: (\d+)h (\d+)m Book flight for \$(\d+)", page.text)
    buttons = [element for element in page.all("button") if element.name.startswith("Book flight for $")]
    if not rows or len(rows) != len(buttons):
        raise PlanFailed("the flights and their buttons do not pair up")
    values = [int(price) for *_, price in rows] if goal == "cheapest" else [int(h) * 60 + int(m) for h, m, _ in rows]
    yield click(buttons[values.index(min(values))])


SOLVERS: dict[str, Callable[[Page], Plan]] = {
    "book-flight": book_flight,
    "book-flight-nodelay": book_flight,
    "buy-ticket": buy_ticket,
    "choose-date": choose_date,
    "choose-date-easy": choose_date,
    "choose-date-medium": choose_date,
    "choose-date-nodelay": choose_date,
    "click-button": click_named_button(r'Click on the "(.+?)" button\.'),
    "click-button-sequence": click_button_sequence,
    "click-checkboxes": click_checkboxes,
    "click-checkboxes-large": click_checkboxes,
    "click-checkboxes-transfer": click_checkboxes,
    "click-dialog": click_dialog,
    "click-dialog-2": click_dialog_2,
    "click-option": click_option,
    "click-tab": click_tab,
    "click-test": click_named_button(r"Click the button\. (.+)$"),
    "click-test-2": click_named_button(r"Click button (\w+)\."),
    "click-test-transfer": click_named_button(r"Click button (\w+)\."),
    "enter-date": fill_and_submit(r"Enter (\d+/\d+/\d+) as the date", _date),
    "enter-password": enter_password,
    "enter-text": fill_and_submit(r'Enter "(.+?)" into the text field'),
    "enter-text-2": enter_text_2,
    "enter-text-dynamic": fill_and_submit(r'Enter "(.+?)" into the text field'),
    "enter-time": fill_and_submit(r"Enter (\d+):(\d+) (AM|PM) as the time", _time),
    "find-word": find_word,
    "focus-text": focus_text,
    "focus-text-2": focus_text_2,
    "form-sequence-2": form_sequence_2,
    "generate-number": generate_number,
    "guess-number": guess_number,
    "login-user": login_user("Login"),
    "login-user-popup": login_user("OK"),
    "odd-or-even": odd_or_even,
    "phone-book": phone_book,
    "read-table": read_table,
    "read-table-2": read_table_2,
    "search-engine": search_engine,
    "simple-algebra": fill_and_submit(r"(x|\d+) ([+-]) (x|\d+) = (-?\d+)", _algebra),
    "simple-arithmetic": fill_and_submit(r"(\d+) ([+x-]) (\d+) =", _arithmetic),
    "text-transform": text_transform,
    "unicode-test": click_named_button(r'Click on the "(.+?)" button\.'),
    "use-autocomplete": use_autocomplete,
    "use-autocomplete-nodelay": use_autocomplete,
    "use-spinner": fill_and_submit(r"Select (-?\d+) with the spinner"),
}


# ----- playing a plan ----------------------------------------------------------------------------------------------


def next_call(observations: Sequence[str]) -> Call:
    """The call to make after an episode's ``observations`` so far (the first call is ``observe``)."""
    if not observations:
        return observe()
    pages = [Page.parse(text) for text in observations]
    task = pages[0].task
    if task not in SOLVERS or len(observations) > MAX_CALLS:
        return finish()
    plan = SOLVERS[task](pages[0])
    try:
        call = next(plan)
        for page in pages[1:]:
            call = plan.send(page)
    except (StopIteration, PlanFailed):
        return finish()
    return call


def render_call(call: Call) -> str:
    """A call as the hermes tool-call text a model writes for the recipe's ``browser`` tool."""
    from ..scripted_policy import tool_call

    return tool_call(SINGLE_TOOL_NAME, json.dumps(call, separators=(",", ":")))


def tool_answers(conversation: str) -> list[str]:
    """Every tool answer of a conversation (a chat-templated text), in order."""
    from ..chat_tokenizer import TOOL_RESPONSE_END, TOOL_RESPONSE_START

    pattern = re.escape(TOOL_RESPONSE_START) + r"\n(.*?)\n" + re.escape(TOOL_RESPONSE_END)
    return re.findall(pattern, conversation, flags=re.DOTALL)


def script(view: Any) -> str:
    """A :mod:`~nemo_gym_browser.local.scripted_policy` script: the next call, from every tool answer of the
    episode so far (a :class:`~nemo_gym_browser.local.scripted_policy.PolicyView` in trajectory mode shows them all)."""
    return render_call(next_call(tool_answers(view.text)))
