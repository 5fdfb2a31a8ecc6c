"""Which MiniWoB++ tasks the five browser tools can express, and why each other task is left out.

The tools are NeMo Gym 0.7.0's: ``observe`` shows the page title, the visible elements matching ``a, button,
input, textarea, select, [role=button], [role=link]`` (each named by its text or its ``value`` *attribute*) and the
body's ``inner_text`` (2000 characters); ``click`` clicks a listed element; ``type`` *fills* a listed element (sets
its value, fires ``input``; no key presses); ``navigate`` opens a URL; ``finish`` ends the episode. So a task is
included when every problem it makes can be solved by reading that text and clicking or filling listed elements.

Every task of the wheel is in exactly one of :data:`INCLUDED` and :data:`EXCLUDED` (``tests/test_miniwob_inventory.py``
checks it against the installed pages). An exclusion names its :class:`Limit`; the limits marked ``nemo_gym`` are
properties of NeMo Gym's observation and action model, not of the pages or of this recipe.

Seeds: seed ``s`` in ``[0, SEED_SPACE)`` is held back when ``s % HELD_BACK_EVERY == HELD_BACK_REMAINDER``, for every
task alike (:func:`seeds`); a task's problem is a function of its seed (:mod:`.pages`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

SPLITS = ("train", "heldback")
SEED_SPACE = 1_000_000
HELD_BACK_EVERY = 5
HELD_BACK_REMAINDER = 4


class Limit(Enum):
    """Why a task is out of the tools' reach. The value is the sentence a reader sees. ``nemo_gym`` marks the gaps of
    NeMo Gym's observation and action model on pages that need nothing but clicks and typing; the others need an
    action the five tools do not have, a moment chosen to the second, or sight."""

    UNLISTED = "the elements to click are of no listed kind (<span>, <div>, <li>, <h3>, <td>, SVG): they get no id"
    SELECT = "needs an <option> chosen: type fills (Playwright refuses a <select>) and options get no id"
    TEXTAREA = "needs the text inside a <textarea>: it is neither body text nor the element's name"
    INPUT_KIND = "needs inputs told apart by kind (checkbox, radio, text): an input is listed as 'input' alone"
    KEYS = "needs key presses (Enter): type fills the value and presses no key"
    DRAG = "needs dragging, drawing or a slider: the tools click and fill only"
    POINT = "needs a click at a point of a drawing (SVG or canvas coordinates)"
    HOVER = "needs the pointer to hover over or follow something"
    SELECTION = "needs text selected with the pointer"
    SCROLL = "needs an element scrolled"
    TIMING = "needs an action at a chosen moment; a tool call's latency (about a second here) cannot be timed"
    PICTURE = "the answer is in a picture (shapes, colours, images) that is not text"

    @property
    def nemo_gym(self) -> bool:
        return self in _NEMO_GYM_LIMITS


_NEMO_GYM_LIMITS = frozenset({Limit.UNLISTED, Limit.SELECT, Limit.TEXTAREA, Limit.INPUT_KIND, Limit.KEYS})


@dataclass(frozen=True)
class Included:
    task: str
    how: str  # what solving it takes, in the tools' terms


@dataclass(frozen=True)
class Excluded:
    task: str
    limit: Limit
    detail: str  # what on this task's page runs into the limit


def _included(*entries: tuple[str, str]) -> tuple[Included, ...]:
    return tuple(Included(task, how) for task, how in entries)


def _excluded(limit: Limit, detail: str, *tasks: str) -> tuple[Excluded, ...]:
    return tuple(Excluded(task, limit, detail) for task in tasks)


_DATE_PICKER = "click the date field, then the picker's Prev/Next links to the month and the day's link; Submit"
_CHECKBOXES = "click the checkboxes whose labels the instruction names (labels follow the inputs' order); Submit"
_AUTOCOMPLETE = "fill the field with text that starts and ends as asked; Submit"

INCLUDED: tuple[Included, ...] = _included(
    ("book-flight", "fill origin and destination with the suggested airport, pick the date, Search, Book the flight"),
    ("book-flight-nodelay", "as book-flight"),
    ("buy-ticket", "click the Book button of the cheapest or shortest flight"),
    ("choose-date", _DATE_PICKER),
    ("choose-date-easy", _DATE_PICKER),
    ("choose-date-medium", _DATE_PICKER),
    ("choose-date-nodelay", _DATE_PICKER),
    ("click-button", "click the named button"),
    ("click-button-sequence", "click the two named buttons in order"),
    ("click-checkboxes", _CHECKBOXES),
    ("click-checkboxes-large", _CHECKBOXES),
    ("click-checkboxes-soft", "as click-checkboxes, with labels of the same meaning as the named words"),
    ("click-checkboxes-transfer", _CHECKBOXES),
    ("click-dialog", "click the dialog's close button"),
    ("click-dialog-2", "click the named button of the dialog"),
    ("click-option", "click the radio button whose label is named (labels follow the inputs' order); Submit"),
    ("click-tab", "click the named tab link"),
    ("click-test", "click the button"),
    ("click-test-2", "click the named button"),
    ("click-test-transfer", "click the named button"),
    ("enter-date", "fill the date field (yyyy-mm-dd); Submit"),
    ("enter-password", "fill both fields with the password; Submit"),
    ("enter-text", "fill the field with the quoted text; Submit"),
    ("enter-text-2", "fill the field with the quoted text in the asked case; Submit"),
    ("enter-text-dynamic", "fill the field with the quoted text; Submit"),
    ("enter-time", "fill the time field (hh:mm, 24 h); Submit"),
    ("find-word", "fill the field with the paragraph's n-th word; Submit"),
    ("focus-text", "click the text field"),
    ("focus-text-2", "click the n-th text field"),
    ("form-sequence-2", "click the n-th radio button, fill the m-th field with the number; Submit"),
    ("generate-number", "click Generate until the number shown fits, then Submit"),
    ("guess-number", "fill a guess, Submit, read higher/lower, repeat"),
    ("login-user", "fill username and password; Login"),
    ("login-user-popup", "as login-user; a popup that disables the form is cancelled"),
    ("odd-or-even", "click Odd or Even beside each number; Submit"),
    ("phone-book", "page with the > link to the contact, click the asked field's link"),
    ("read-table", "fill the field with the table's value for the label; Submit"),
    ("read-table-2", "fill each labelled field with the table's value; Submit"),
    ("search-engine", "fill the query, Search, page to the n-th result, click it"),
    ("simple-algebra", "fill x; Submit"),
    ("simple-arithmetic", "fill the result; Submit"),
    ("text-transform", "fill the field with the (skewed) text; Submit"),
    ("unicode-test", "click the named button"),
    ("use-autocomplete", _AUTOCOMPLETE),
    ("use-autocomplete-nodelay", _AUTOCOMPLETE),
    ("use-spinner", "fill the spinner's field with the number; Submit"),
)

EXCLUDED: tuple[Excluded, ...] = (
    *_excluded(Limit.UNLISTED, "the numbers are SVG text", "ascending-numbers"),
    *_excluded(Limit.UNLISTED, "the section headers are <h3> (jQuery UI accordion)", "click-collapsible"),
    *_excluded(Limit.UNLISTED, "as click-collapsible", "click-collapsible-nodelay"),
    *_excluded(
        Limit.UNLISTED,
        "the section headers are <h3> and the links <span class=alink>",
        "click-collapsible-2",
        "click-collapsible-2-nodelay",
    ),
    *_excluded(Limit.UNLISTED, "the links are <span class=alink>", "click-link"),
    *_excluded(
        Limit.UNLISTED,
        "the tabs are links but the target links are <span class=alink>",
        "click-tab-2",
        "click-tab-2-easy",
        "click-tab-2-hard",
        "click-tab-2-medium",
    ),
    *_excluded(Limit.UNLISTED, "the menu items are <li> (jQuery UI menu)", "click-menu", "click-menu-2"),
    *_excluded(
        Limit.UNLISTED,
        "the emails are <div> rows and the star, trash, reply and forward icons <span>",
        "email-inbox",
        "email-inbox-delete",
        "email-inbox-forward",
        "email-inbox-forward-nl",
        "email-inbox-forward-nl-turk",
        "email-inbox-important",
        "email-inbox-nl-turk",
        "email-inbox-noscroll",
        "email-inbox-reply",
        "email-inbox-star-reply",
    ),
    *_excluded(
        Limit.UNLISTED,
        "the reply, retweet, like and menu buttons are <span>",
        "social-media",
        "social-media-all",
        "social-media-some",
    ),
    *_excluded(Limit.UNLISTED, "the cards are <div>", "find-greatest"),
    *_excluded(Limit.UNLISTED, "the + and - controls are <span>", "order-food"),
    *_excluded(Limit.UNLISTED, "the folders and files are <span>", "navigate-tree"),
    *_excluded(Limit.UNLISTED, "the squares are <div>", "tic-tac-toe"),
    *_excluded(Limit.UNLISTED, "the submit button is a <div> (its one layout)", "multi-orderings"),
    *_excluded(Limit.UNLISTED, "two of its five layouts have a <div> as the submit button", "multi-layouts"),
    *_excluded(Limit.SELECT, "a <select> list", "choose-list"),
    *_excluded(Limit.SELECT, "a <select multiple> list", "click-scroll-list"),
    *_excluded(Limit.SELECT, "a <select> dropdown", "form-sequence-3"),
    *_excluded(Limit.TEXTAREA, "the text to copy is in a <textarea>", "copy-paste", "copy-paste-2"),
    *_excluded(Limit.TEXTAREA, "the text to read is in a <textarea>", "scroll-text"),
    *_excluded(Limit.INPUT_KIND, "a checkbox and a radio button look alike", "click-widget"),
    *_excluded(Limit.KEYS, "a command runs on Enter", "terminal"),
    *_excluded(
        Limit.DRAG,
        "items, shapes or boxes are dragged",
        "drag-box",
        "drag-circle",
        "drag-cube",
        "drag-items",
        "drag-items-grid",
        "drag-shapes",
        "drag-shapes-2",
        "drag-single-shape",
        "drag-sort-numbers",
        "daily-calendar",
    ),
    *_excluded(Limit.DRAG, "a shape is drawn with the pointer", "draw-circle", "draw-line"),
    *_excluded(Limit.DRAG, "the textarea's corner is dragged", "resize-textarea"),
    *_excluded(Limit.DRAG, "a jQuery UI slider is moved", "use-slider", "use-slider-2", "form-sequence"),
    *_excluded(Limit.DRAG, "a colour is picked on a wheel", "use-colorwheel", "use-colorwheel-2"),
    *_excluded(
        Limit.POINT,
        "points are clicked on an SVG drawing",
        "bisect-angle",
        "circle-center",
        "find-midpoint",
        "grid-coordinate",
        "right-angle",
    ),
    *_excluded(Limit.POINT, "the pie menu is SVG", "click-pie", "click-pie-nodelay"),
    *_excluded(Limit.POINT, "the shapes are SVG", "click-shape"),
    *_excluded(Limit.HOVER, "the pointer follows a moving circle", "chase-circle"),
    *_excluded(Limit.HOVER, "the pointer hovers over a shape", "hover-shape"),
    *_excluded(Limit.HOVER, "the hot area is found by moving the pointer", "hot-cold"),
    *_excluded(Limit.SELECTION, "a paragraph is highlighted", "highlight-text", "highlight-text-2"),
    *_excluded(Limit.SELECTION, "the editor's text is selected before a style", "text-editor"),
    *_excluded(Limit.SCROLL, "the textarea is scrolled to its top", "scroll-text-2"),
    *_excluded(Limit.SCROLL, "two of its three problems unlock the form by scrolling a textarea", "sign-agreement"),
    *_excluded(Limit.TIMING, "button TWO must follow ONE after 1-3 s, within 15 %", "button-delay"),
    *_excluded(Limit.TIMING, "the price changes every 100 ms for 10 s", "stock-market"),
    *_excluded(Limit.TIMING, "circles move every few hundred ms", "moving-items"),
    *_excluded(Limit.TIMING, "the buttons flash a sequence in colour", "simon-says"),
    *_excluded(Limit.PICTURE, "the boxes differ by colour", "click-color", "click-shades"),
    *_excluded(Limit.PICTURE, "the figure is SVG", "identify-shape", "count-shape", "count-sides"),
    *_excluded(Limit.PICTURE, "the blocks to count are drawn", "visual-addition"),
    *_excluded(Limit.PICTURE, "the digit to draw is an image", "number-checkboxes"),
)


def included_tasks() -> list[str]:
    return [entry.task for entry in INCLUDED]


def excluded_by_task() -> dict[str, Excluded]:
    return {entry.task: entry for entry in EXCLUDED}


def is_held_back(seed: int) -> bool:
    return seed % HELD_BACK_EVERY == HELD_BACK_REMAINDER


def seeds(split: str, count: int, *, start: int = 0) -> list[int]:
    """The first ``count`` seeds of ``split`` from ``start`` on (the same for every task)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return list(_take(_split_seeds(split == "heldback", start), count))


def _split_seeds(held_back: bool, start: int) -> Iterator[int]:
    for seed in range(start, SEED_SPACE):
        if is_held_back(seed) == held_back:
            yield seed


def _take(seeds_: Iterator[int], count: int) -> Iterator[int]:
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    for index, seed in enumerate(seeds_):
        if index >= count:
            return
        yield seed
    raise ValueError(f"fewer than {count} seeds below {SEED_SPACE}")
