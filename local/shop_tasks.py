"""The Corner Shop: a small local web site and graded task suites over it, for training and evaluating on CPU.

Contract: one catalogue (:data:`CATEGORIES`, six sections of four priced items) renders every page of
``local/site/shop/`` (:func:`render_pages`) and the task files ``examples/shop_tasks_*.jsonl``
(:func:`task_records`: open, browse, search and price tasks, one of each per item, the items of
:data:`HELD_BACK_ITEMS` held back); ``python -m nemo_gym_browser.local.shop_tasks --write`` regenerates them and
``--check`` fails when a committed file differs. :data:`SUITES` adds ``deal`` (one browser call) and ``aisle`` (two
dependent calls). :func:`in_process_site` is the same pages for the in-process environment server, whose
observations equal the real server's; :func:`serve` serves the real pages on :data:`SHOP_PORT`, the fixed loopback
port the task files name (a free port would change every prompt). The scripted player is :mod:`.shop_scripts`.
The suites in full: ``docs/rehearsal-and-cpu-training.md``.
"""

from __future__ import annotations

import argparse
import html
import json
import logging
import random
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from .environment_server.site_model import Page, PageState, Site, button, link, text_input
from .local_site import SITE_DIR, LocalSite

logger = logging.getLogger(__name__)

SHOP_PORT = 8765
SHOP_ORIGIN = f"http://127.0.0.1:{SHOP_PORT}"
SHOP_FOLDER = "shop"
SHOP_DIR = SITE_DIR / SHOP_FOLDER
SITE_NAME = "Corner Shop"
EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
TRAIN_FILE = EXAMPLES_DIR / "shop_tasks_train.jsonl"
HELD_BACK_FILE = EXAMPLES_DIR / "shop_tasks_heldback.jsonl"
DEAL_TRAIN_FILE = EXAMPLES_DIR / "deal_tasks_train.jsonl"
DEAL_HELD_BACK_FILE = EXAMPLES_DIR / "deal_tasks_heldback.jsonl"
AISLE_TRAIN_FILE = EXAMPLES_DIR / "aisle_tasks_train.jsonl"
AISLE_HELD_BACK_FILE = EXAMPLES_DIR / "aisle_tasks_heldback.jsonl"
KINDS = ("open", "browse", "search", "price")
# The suites: lookup (act on the element whose text the task names; out of reach of the tiny policy), deal (name the
# item marked on sale: learnable by pointing at the mark, or guessable from memory one time in four) and aisle (the
# same answer two dependent browser calls away: point at the marked aisle's link, then at its board's mark).
SUITES = ("lookup", "deal", "aisle")
SUITE_FILES: Mapping[str, tuple[Path, Path]] = {
    "lookup": (TRAIN_FILE, HELD_BACK_FILE),
    "deal": (DEAL_TRAIN_FILE, DEAL_HELD_BACK_FILE),
    "aisle": (AISLE_TRAIN_FILE, AISLE_HELD_BACK_FILE),
}
# Deal boards list the fruit, one marked on sale; one page (deals.html?board=N) draws board N with a script. Every
# DEAL_HELD_BACK_EVERY-th board is held back (both splits' start URLs have numbers of the same shape). Each fruit is
# on sale on the same number of boards of each split, so an answer from memory (any fruit) is right one time in
# four, and there are too many boards for a small policy to learn each board's answer by its URL.
DEAL_SECTION = "Fruit"
DEAL_TASKS_PER_FRUIT = {"train": 240, "heldback": 60}
DEAL_HELD_BACK_EVERY = 5
DEAL_PAGE = "deals.html"
SALE_MARK = "(sale)"
# Aisle days: the start page (aisles.html?day=N) lists four aisles in an order drawn from N and marks the one whose
# stand has the fruit deal; each aisle's stand (aisle.html?day=N&aisle=SLUG) is a deal board, and the four stands of a
# day put four different fruit on sale, so following any other aisle gives a wrong answer. Split, balance and page
# scripts as for the deal boards; every item name is one token of the policy's vocabulary, and so is each aisle's.
AISLES = ("Tools", "Books", "Toys", "Garden")
AISLE_TASKS_PER_FRUIT = DEAL_TASKS_PER_FRUIT
AISLE_HELD_BACK_EVERY = DEAL_HELD_BACK_EVERY
AISLES_PAGE = "aisles.html"
AISLE_PAGE = "aisle.html"
# Its word shares no token with the aisle names, the pages' text, the question or the sale mark: the policy points at
# the mark, so nothing else should look like it.
DEAL_MARK = "(deal)"


@dataclass(frozen=True)
class Item:
    name: str
    price: int
    section: str

    @property
    def slug(self) -> str:
        return self.name.lower()


# Section -> (item, price). Names are one plain word each, so a task names an element by exactly its text.
CATEGORIES: Mapping[str, tuple[tuple[str, int], ...]] = {
    "Fruit": (("Apple", 3), ("Banana", 2), ("Cherry", 6), ("Mango", 4)),
    "Tools": (("Hammer", 9), ("Saw", 7), ("Drill", 8), ("Wrench", 5)),
    "Books": (("Atlas", 6), ("Novel", 4), ("Diary", 3), ("Comic", 2)),
    "Toys": (("Kite", 5), ("Puzzle", 7), ("Robot", 9), ("Yoyo", 2)),
    "Drinks": (("Coffee", 4), ("Tea", 3), ("Juice", 5), ("Soda", 2)),
    "Garden": (("Rake", 6), ("Shovel", 8), ("Hose", 7), ("Seeds", 3)),
}
# One per section, at positions 3, 1, 0, 2, 3, 2: the held-back items are not all the n-th link of their page.
HELD_BACK_ITEMS = frozenset({"Mango", "Saw", "Atlas", "Robot", "Soda", "Hose"})


def items() -> list[Item]:
    return [Item(name, price, section) for section, entries in CATEGORIES.items() for name, price in entries]


def section_file(section: str) -> str:
    return f"{section.lower()}.html"


def item_file(item: Item) -> str:
    return f"{item.slug}.html"


def page_url(file: str, origin: str = SHOP_ORIGIN) -> str:
    return f"{origin}/{SHOP_FOLDER}/{file}"


def price_text(item: Item) -> str:
    """The line of the item's page that states its price (what ``browse`` tasks are graded on)."""
    return f"{item.name}: {item.price} coins."


# ----- the pages -----------------------------------------------------------------------------------------------

_HEAD = '<!doctype html>\n<html lang="en">\n<head>\n  <meta charset="utf-8">\n  <title>{title}</title>\n</head>\n'
_INDEX_TEXT = "Pick a section or search."
_NO_QUERY = "No query."
_NOTHING_FOUND = "No items found."
_HOME = "Home"
SEARCH_LABEL = "Search"  # the search button's text, which the scripted player looks for


def _document(title: str, body: Sequence[str]) -> str:
    lines = "\n".join(f"  {line}" for line in body)
    return _HEAD.format(title=html.escape(title)) + f"<body>\n{lines}\n</body>\n</html>\n"


def _links(entries: Sequence[tuple[str, str]]) -> list[str]:
    return ["<ul>", *(f'  <li><a href="{href}">{html.escape(name)}</a></li>' for name, href in entries), "</ul>"]


def _search_script() -> list[str]:
    catalogue = json.dumps({item.slug: item.name for item in items()}, separators=(",", ":"))
    return [
        "<script>",
        f"  const items = {catalogue};",
        '  const q = (new URLSearchParams(location.search).get("q") || "").trim();',
        "  if (q) {",
        '    document.getElementById("summary").textContent = "Results for: " + q;',
        '    const key = q.toLowerCase(), found = document.getElementById("found");',
        "    if (Object.hasOwn(items, key)) {",
        '      const entry = document.createElement("li"), anchor = document.createElement("a");',
        '      anchor.href = key + ".html";',
        "      anchor.textContent = items[key];",
        "      entry.append(anchor);",
        "      found.append(entry);",
        "    } else {",
        f'      found.insertAdjacentHTML("afterend", "<p>{_NOTHING_FOUND}</p>");',
        "    }",
        "  }",
        "</script>",
    ]


@dataclass(frozen=True)
class DealBoard:
    """Board ``number``: the fruit in one of their 24 orders, one of them marked on sale (:func:`deal_board`)."""

    number: int
    order: tuple[str, ...]
    sale: str

    @property
    def file(self) -> str:
        return f"{DEAL_PAGE}?board={self.number}"

    @property
    def split(self) -> str:
        return "heldback" if self.number % DEAL_HELD_BACK_EVERY == DEAL_HELD_BACK_EVERY - 1 else "train"

    def label(self, name: str) -> str:
        return f"{name} {SALE_MARK}" if name == self.sale else name


_DEALS_TITLE = "Deals"
_DEAL_TEXT = "One item is on sale today."
_NO_BOARD = "No such board."


def deal_names() -> list[str]:
    """The items a deal board lists (the plausible answers)."""
    return [name for name, _ in CATEGORIES[DEAL_SECTION]]


def _board_hash(number: int) -> int:
    # A linear congruential step: the page's script computes the same (every product stays below 2**53).
    return (number * 1103515245 + 12345) % 2**31


def _permutation(names: Sequence[str], rank: int) -> tuple[str, ...]:
    """The ``rank``-th (0..23) order of four names (factorial number system), as the pages' scripts compute it."""
    pool, order = list(names), []
    for size in (6, 2, 1, 1):
        order.append(pool.pop(rank // size))
        rank %= size
    return tuple(order)


# The same permutation in the pages' scripts.
_PERMUTATION_JS = [
    "  function permutation(names, rank) {",
    "    const pool = names.slice(), order = [];",
    "    for (const size of [6, 2, 1, 1]) {",
    "      order.push(pool.splice(Math.floor(rank / size), 1)[0]);",
    "      rank %= size;",
    "    }",
    "    return order;",
    "  }",
]


def deal_board(number: int) -> DealBoard:
    """Board ``number`` as ``deals.html``'s script draws it: order and sale from a hash of the number (so neither
    follows from its last digits), the order as the ``k``-th permutation (factorial number system)."""
    h = _board_hash(number)
    return DealBoard(number, _permutation(deal_names(), (h >> 8) % 24), deal_names()[(h >> 16) % 4])


def deal_boards() -> list[DealBoard]:
    """The boards of the task files: the first boards of each split, until every fruit is on sale on
    :data:`DEAL_TASKS_PER_FRUIT` of them."""
    return _balanced(deal_board, DEAL_TASKS_PER_FRUIT)


def _balanced(draw: Any, per_fruit: Mapping[str, int]) -> list[Any]:
    """``draw(0)``, ``draw(1)``, ... kept while their answer (``.sale``) is still short of ``per_fruit`` in their
    split (``.split``), until every fruit is the answer ``per_fruit[split]`` times in each split."""
    counts = {split: dict.fromkeys(deal_names(), 0) for split in per_fruit}
    kept, number = [], 0
    while any(n < per_fruit[split] for split, per in counts.items() for n in per.values()):
        drawn = draw(number)
        if counts[drawn.split][drawn.sale] < per_fruit[drawn.split]:
            counts[drawn.split][drawn.sale] += 1
            kept.append(drawn)
        number += 1
    return kept


@dataclass(frozen=True)
class AisleDay:
    """Day ``number`` of the aisle suite (:func:`aisle_day`): the aisles in one of their 24 orders, the one with the
    deal, and the fruit on sale at each aisle's stand (four different ones)."""

    number: int
    order: tuple[str, ...]
    deal_aisle: str
    sales: Mapping[str, str]  # aisle -> the fruit its stand marks on sale

    @property
    def file(self) -> str:
        return f"{AISLES_PAGE}?day={self.number}"

    @property
    def sale(self) -> str:
        """The answer: the fruit on sale at the aisle the start page marks."""
        return self.sales[self.deal_aisle]

    @property
    def split(self) -> str:
        return "heldback" if self.number % AISLE_HELD_BACK_EVERY == AISLE_HELD_BACK_EVERY - 1 else "train"

    def label(self, aisle: str) -> str:
        return f"{aisle} {DEAL_MARK}" if aisle == self.deal_aisle else aisle

    def stand_file(self, aisle: str) -> str:
        return f"{AISLE_PAGE}?day={self.number}&aisle={aisle.lower()}"

    def stand(self, aisle: str) -> DealBoard:
        """The deal board of ``aisle``'s stand (its ``number`` is the day's)."""
        index = AISLES.index(aisle)
        order = _permutation(deal_names(), (_board_hash(4 * self.number + index) >> 8) % 24)
        return DealBoard(self.number, order, self.sales[aisle])


def aisle_day(number: int) -> AisleDay:
    """Day ``number`` as ``aisles.html`` and ``aisle.html`` draw it, from a hash of the number: the aisles' order,
    the marked aisle, and which fruit each aisle's stand has on sale (one permutation of the four)."""
    h = _board_hash(number)
    sales = _permutation(deal_names(), (h >> 20) % 24)
    return AisleDay(
        number,
        _permutation(AISLES, (h >> 8) % 24),
        AISLES[(h >> 16) % 4],
        dict(zip(AISLES, sales, strict=True)),
    )


def aisle_days() -> list[AisleDay]:
    """The days of the task files: the first days of each split, until every fruit is the answer of
    :data:`AISLE_TASKS_PER_FRUIT` of them."""
    return _balanced(aisle_day, AISLE_TASKS_PER_FRUIT)


def _deals_script() -> list[str]:
    names = json.dumps(deal_names())
    return [
        "<script>",
        f"  const names = {names};",
        '  const raw = new URLSearchParams(location.search).get("board") || "";',
        "  if (/^[0-9]{1,6}$/.test(raw)) {",
        "    const h = (Number(raw) * 1103515245 + 12345) % 2147483648;",
        "    const pool = names.slice(), order = [];",
        "    let rank = Math.floor(h / 256) % 24;",
        "    for (const size of [6, 2, 1, 1]) {",
        "      order.push(pool.splice(Math.floor(rank / size), 1)[0]);",
        "      rank %= size;",
        "    }",
        '    const sale = names[Math.floor(h / 65536) % 4], board = document.getElementById("board");',
        "    for (const name of order) {",
        '      const entry = document.createElement("li"), anchor = document.createElement("a");',
        '      anchor.href = name.toLowerCase() + ".html";',
        f'      anchor.textContent = name === sale ? name + " {SALE_MARK}" : name;',
        "      entry.append(anchor);",
        "      board.append(entry);",
        "    }",
        "  } else {",
        f'    document.getElementById("summary").textContent = "{_NO_BOARD}";',
        "  }",
        "</script>",
    ]


_AISLES_TITLE = "Aisles"
_AISLES_TEXT = "One aisle has the fruit on sale."
_NO_DAY = "No such day."
_NO_AISLE = "No such aisle."
_NUMBER_PATTERN = "[0-9]{1,6}"


def _aisles_script() -> list[str]:
    return [
        "<script>",
        f"  const aisles = {json.dumps(list(AISLES))};",
        *_PERMUTATION_JS,
        '  const raw = new URLSearchParams(location.search).get("day") || "";',
        f"  if (/^{_NUMBER_PATTERN}$/.test(raw)) {{",
        "    const day = Number(raw), h = (day * 1103515245 + 12345) % 2147483648;",
        '    const marked = aisles[Math.floor(h / 65536) % 4], list = document.getElementById("aisles");',
        "    for (const name of permutation(aisles, Math.floor(h / 256) % 24)) {",
        '      const entry = document.createElement("li"), anchor = document.createElement("a");',
        f'      anchor.href = "{AISLE_PAGE}?day=" + day + "&aisle=" + name.toLowerCase();',
        f'      anchor.textContent = name === marked ? name + " {DEAL_MARK}" : name;',
        "      entry.append(anchor);",
        "      list.append(entry);",
        "    }",
        "  } else {",
        f'    document.getElementById("summary").textContent = "{_NO_DAY}";',
        "  }",
        "</script>",
    ]


def _aisle_script() -> list[str]:
    return [
        "<script>",
        f"  const names = {json.dumps(deal_names())}, aisles = {json.dumps([a.lower() for a in AISLES])};",
        *_PERMUTATION_JS,
        "  const query = new URLSearchParams(location.search);",
        '  const raw = query.get("day") || "", index = aisles.indexOf(query.get("aisle") || "");',
        f"  if (/^{_NUMBER_PATTERN}$/.test(raw) && index >= 0) {{",
        "    const day = Number(raw), hash = (n) => (n * 1103515245 + 12345) % 2147483648;",
        "    const sale = permutation(names, Math.floor(hash(day) / 1048576) % 24)[index];",
        '    const board = document.getElementById("board");',
        "    for (const name of permutation(names, Math.floor(hash(4 * day + index) / 256) % 24)) {",
        '      const entry = document.createElement("li"), anchor = document.createElement("a");',
        '      anchor.href = name.toLowerCase() + ".html";',
        f'      anchor.textContent = name === sale ? name + " {SALE_MARK}" : name;',
        "      entry.append(anchor);",
        "      board.append(entry);",
        "    }",
        "  } else {",
        f'    document.getElementById("summary").textContent = "{_NO_AISLE}";',
        "  }",
        "</script>",
    ]


def render_pages() -> dict[str, str]:
    """File name -> HTML of every page of the shop (``local/site/shop/``)."""
    sections = [(section, section_file(section)) for section in CATEGORIES]
    pages = {
        "index.html": _document(
            SITE_NAME,
            [
                f"<h1>{SITE_NAME}</h1>",
                f"<p>{_INDEX_TEXT}</p>",
                *_links(sections),
                '<form action="search.html" method="get">',
                '  <input name="q" type="text">',
                f'  <button type="submit">{SEARCH_LABEL}</button>',
                "</form>",
            ],
        ),
        "search.html": _document(
            SEARCH_LABEL,
            [
                f"<h1>{SEARCH_LABEL}</h1>",
                f'<p id="summary">{_NO_QUERY}</p>',
                '<ul id="found"></ul>',
                f'<p><a href="index.html">{_HOME}</a></p>',
                *_search_script(),
            ],
        ),
    }
    for section, entries in CATEGORIES.items():
        listed = [(name, f"{name.lower()}.html") for name, _ in entries]
        pages[section_file(section)] = _document(
            section, [f"<h1>{section}</h1>", *_links(listed), f'<p><a href="index.html">{_HOME}</a></p>']
        )
    for item in items():
        pages[item_file(item)] = _document(
            item.name,
            [
                f"<h1>{item.name}</h1>",
                f"<p>{html.escape(price_text(item))}</p>",
                f'<p><a href="{section_file(item.section)}">Back to {item.section}</a></p>',
            ],
        )
    pages[DEAL_PAGE] = _document(
        _DEALS_TITLE,
        [
            f"<h1>{_DEALS_TITLE}</h1>",
            f'<p id="summary">{_DEAL_TEXT}</p>',
            '<ul id="board"></ul>',
            f'<p><a href="index.html">{_HOME}</a></p>',
            *_deals_script(),
        ],
    )
    pages[AISLES_PAGE] = _document(
        _AISLES_TITLE,
        [
            f"<h1>{_AISLES_TITLE}</h1>",
            f'<p id="summary">{_AISLES_TEXT}</p>',
            '<ul id="aisles"></ul>',
            f'<p><a href="index.html">{_HOME}</a></p>',
            *_aisles_script(),
        ],
    )
    pages[AISLE_PAGE] = _document(
        _DEALS_TITLE,
        [
            f"<h1>{_DEALS_TITLE}</h1>",
            f'<p id="summary">{_DEAL_TEXT}</p>',
            '<ul id="board"></ul>',
            f'<p><a href="index.html">{_HOME}</a></p>',
            *_aisle_script(),
        ],
    )
    return pages


# ----- the same pages for the in-process server -----------------------------------------------------------------------


def _submit_search(page: PageState) -> str:
    # A GET form: the browser encodes the field as application/x-www-form-urlencoded.
    return "search.html?" + urlencode({"q": page.value("q")})


def _deals_page(raw: str) -> Page:
    if not re.fullmatch(_NUMBER_PATTERN, raw):
        return _missing(_DEALS_TITLE, _NO_BOARD)
    return _board_page(deal_board(int(raw)))


def _missing(title: str, message: str) -> Page:
    return Page(title=title, text=f"{title}\n{message}\n{_HOME}", elements=(link(_HOME, "index.html"),))


def _board_page(board: DealBoard) -> Page:
    labels = [board.label(name) for name in board.order]
    return Page(
        title=_DEALS_TITLE,
        text="\n".join([_DEALS_TITLE, _DEAL_TEXT, *labels, _HOME]),
        elements=(
            *(link(board.label(name), f"{name.lower()}.html") for name in board.order),
            link(_HOME, "index.html"),
        ),
    )


def _aisles_page(raw: str) -> Page:
    if not re.fullmatch(_NUMBER_PATTERN, raw):
        return _missing(_AISLES_TITLE, _NO_DAY)
    day = aisle_day(int(raw))
    labels = [day.label(aisle) for aisle in day.order]
    return Page(
        title=_AISLES_TITLE,
        text="\n".join([_AISLES_TITLE, _AISLES_TEXT, *labels, _HOME]),
        elements=(
            *(link(day.label(aisle), day.stand_file(aisle)) for aisle in day.order),
            link(_HOME, "index.html"),
        ),
    )


def _aisle_page(raw: str, slug: str) -> Page:
    by_slug = {aisle.lower(): aisle for aisle in AISLES}
    if not re.fullmatch(_NUMBER_PATTERN, raw) or slug not in by_slug:
        return _missing(_DEALS_TITLE, _NO_AISLE)
    return _board_page(aisle_day(int(raw)).stand(by_slug[slug]))


def _search_page(query: str) -> Page:
    query = query.strip()
    if not query:
        return Page(
            title=SEARCH_LABEL, text=f"{SEARCH_LABEL}\n{_NO_QUERY}\n{_HOME}", elements=(link(_HOME, "index.html"),)
        )
    by_slug = {item.slug: item for item in items()}
    found = by_slug.get(query.lower())
    if found is None:
        text = f"{SEARCH_LABEL}\nResults for: {query}\n{_NOTHING_FOUND}\n{_HOME}"
        return Page(title=SEARCH_LABEL, text=text, elements=(link(_HOME, "index.html"),))
    text = f"{SEARCH_LABEL}\nResults for: {query}\n{found.name}\n{_HOME}"
    return Page(title=SEARCH_LABEL, text=text, elements=(link(found.name, item_file(found)), link(_HOME, "index.html")))


class ShopSite(Site):
    """The in-process server's copy of the shop: a page table, plus the search page computed from its query string."""

    def __init__(self, pages: Mapping[str, Page], *, origin: str, **kwargs: Any) -> None:
        super().__init__(pages, **kwargs)
        self._search = page_url("search.html", origin)
        self._deals = page_url(DEAL_PAGE, origin)
        self._aisles = page_url(AISLES_PAGE, origin)
        self._aisle = page_url(AISLE_PAGE, origin)

    def page(self, url: str) -> Page | None:
        parts = urlsplit(url.partition("#")[0])
        where = f"{parts.scheme}://{parts.netloc}{parts.path}"
        if where == self._search:
            return _search_page(parse_qs(parts.query).get("q", [""])[0])
        query = parse_qs(parts.query)
        if where == self._deals:
            return _deals_page(query.get("board", [""])[0])
        if where == self._aisles:
            return _aisles_page(query.get("day", [""])[0])
        if where == self._aisle:
            return _aisle_page(query.get("day", [""])[0], query.get("aisle", [""])[0])
        return super().page(url)


def in_process_site(
    origin: str = SHOP_ORIGIN, *, base: Site | None = None, order_seed: int | str | None = None
) -> ShopSite:
    """The shop at ``origin`` for :class:`~.environment_server.server.InProcessEnvironmentServer`, over ``base``'s pages
    (default: the real server's bundled ``site/``, so the server's own example episode still works).

    ``order_seed``: list the sections on the home page and the items on each section page in a shuffled order
    (seeded), instead of the real site's, so that demonstrations cannot teach which position to click.
    """
    base = base if base is not None else Site.bundled()
    rng = random.Random(order_seed) if order_seed is not None else None

    def ordered(names: Sequence[str]) -> list[str]:
        names = list(names)
        if rng is not None:
            rng.shuffle(names)
        return names

    pages = {url: base.page(url) for url in base.urls}
    sections = ordered(CATEGORIES)
    pages[page_url("index.html", origin)] = Page(
        title=SITE_NAME,
        text="\n".join([SITE_NAME, _INDEX_TEXT, *sections, SEARCH_LABEL]),
        elements=(
            *(link(section, section_file(section)) for section in sections),
            text_input("q"),
            button(SEARCH_LABEL, on_click=_submit_search),
        ),
    )
    for section, entries in CATEGORIES.items():
        names = ordered(name for name, _ in entries)
        pages[page_url(section_file(section), origin)] = Page(
            title=section,
            text="\n".join([section, *names, _HOME]),
            elements=(*(link(name, f"{name.lower()}.html") for name in names), link(_HOME, "index.html")),
        )
    for item in items():
        back = f"Back to {item.section}"
        pages[page_url(item_file(item), origin)] = Page(
            title=item.name,
            text="\n".join([item.name, price_text(item), back]),
            elements=(link(back, section_file(item.section)),),
        )
    return ShopSite(pages, origin=origin, root=base.root)


def serve(port: int = SHOP_PORT) -> LocalSite:
    """The real pages on ``http://127.0.0.1:<port>`` (not started: use it as a context manager)."""
    return LocalSite(SITE_DIR, port=port)


# ----- the tasks ------------------------------------------------------------------------------------------------


def _task(kind: str, item: Item, origin: str) -> dict[str, Any]:
    """One task in WebVoyager's format; ``kind``, ``item`` and ``split`` are kept by the preparation as metadata."""
    section_page, home = page_url(section_file(item.section), origin), page_url("index.html", origin)
    if kind == "open":
        start, question = section_page, f"Open the {item.name} page."
        verifier = {"final_url": page_url(item_file(item), origin)}
    elif kind == "browse":
        start, question = home, f"Go to {item.section}, then open {item.name}."
        verifier = {"dom_contains": price_text(item)}
    elif kind == "search":
        start, question = home, f'Search the shop for "{item.slug}".'
        verifier = {"url_contains": "search.html?" + urlencode({"q": item.slug})}
    elif kind == "price":
        start, question = home, f"Go to {item.section}, open {item.name} and report its price."
        verifier = {"answer_equals": str(item.price)}
    else:
        raise ValueError(f"unknown task kind {kind!r}; known: {KINDS}")
    return {
        "web_name": SITE_NAME,
        "id": f"shop--{kind}-{item.slug}",
        "ques": question,
        "web": start,
        "verifier_metadata": verifier,
        "kind": kind,
        "item": item.name,
        "split": "heldback" if item.name in HELD_BACK_ITEMS else "train",
    }


DEAL_QUESTION = "Which fruit is on sale today? Answer with its name."


def _sale_task(kind: str, question: str, number: int, file: str, sale: str, split: str, origin: str) -> dict[str, Any]:
    """A task whose answer is the fruit on sale, graded by the server's ``answer_equals`` (deal and aisle suites)."""
    return {
        "web_name": SITE_NAME,
        "id": f"shop--{kind}-{number}",
        "ques": question,
        "web": page_url(file, origin),
        "verifier_metadata": {"answer_equals": sale},
        "kind": kind,
        "item": sale,
        "split": split,
    }


def _deal_task(board: DealBoard, origin: str) -> dict[str, Any]:
    return _sale_task("deal", DEAL_QUESTION, board.number, board.file, board.sale, board.split, origin)


AISLE_QUESTION = "Which fruit is on sale today? Open the aisle that has it, then answer with the fruit's name."


def _aisle_task(day: AisleDay, origin: str) -> dict[str, Any]:
    return _sale_task("aisle", AISLE_QUESTION, day.number, day.file, day.sale, day.split, origin)


def task_records(split: str | None = None, origin: str = SHOP_ORIGIN, *, suite: str = "lookup") -> list[dict[str, Any]]:
    """The tasks of ``suite`` (all, or those of ``split``: ``train`` or ``heldback``).

    ``lookup``: ordered by kind, then catalogue order. ``deal``: by board number. ``aisle``: by day number.
    """
    if split not in (None, "train", "heldback"):
        raise ValueError(f"split must be 'train', 'heldback' or None, got {split!r}")
    if suite == "lookup":
        records = [_task(kind, item, origin) for kind in KINDS for item in items()]
    elif suite == "deal":
        records = [_deal_task(board, origin) for board in deal_boards()]
    elif suite == "aisle":
        records = [_aisle_task(day, origin) for day in aisle_days()]
    else:
        raise ValueError(f"unknown suite {suite!r}; known: {SUITES}")
    return [record for record in records if split is None or record["split"] == split]


def records_by_id(origin: str = SHOP_ORIGIN) -> dict[str, dict[str, Any]]:
    """Every task of every suite, by id."""
    return {record["id"]: record for suite in SUITES for record in task_records(origin=origin, suite=suite)}


def _jsonl(records: Sequence[Mapping[str, Any]]) -> str:
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def rendered_files() -> dict[Path, str]:
    """Every file this module renders, by path: the shop's pages and the two task files."""
    files = {SHOP_DIR / name: text for name, text in render_pages().items()}
    for suite, (train, held_back) in SUITE_FILES.items():
        files[train] = _jsonl(task_records("train", suite=suite))
        files[held_back] = _jsonl(task_records("heldback", suite=suite))
    return files


def stale_files() -> list[Path]:
    """Committed files that differ from what the catalogue renders (or are missing), and stray shop pages."""
    files = rendered_files()
    stale = [path for path, text in files.items() if not path.is_file() or path.read_text(encoding="utf-8") != text]
    strays = sorted(set(SHOP_DIR.glob("*.html")) - set(files)) if SHOP_DIR.is_dir() else []
    return stale + strays


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_gym_browser.local.shop_tasks",
        description="The Corner Shop test site and its task suite: check or regenerate the committed files.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"""\
examples:
  python -m nemo_gym_browser.local.shop_tasks --check      # are site and task files current?
  python -m nemo_gym_browser.local.shop_tasks --write      # regenerate them from the catalogue
  python -m nemo_gym_browser.local.shop_tasks --serve      # serve the site on {SHOP_ORIGIN} until Ctrl-C

  # the task files are WebVoyager task lists; prepare them like any other (every task of a file goes to its
  # train.jsonl with --val-fraction 0: use the held-back file's rows as verl's validation set)
  python prepare_webvoyager_data.py --input examples/shop_tasks_train.jsonl --val-fraction 0 --output-dir data/shop
  python prepare_webvoyager_data.py --input examples/shop_tasks_heldback.jsonl --val-fraction 0 \\
      --output-dir data/shop-heldback

exit status: 0 ok, 1 --check found stale files, 2 usage error.""",
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--check", action="store_true", help="exit 1 if a committed file is not what is rendered")
    action.add_argument("--write", action="store_true", help="write the site pages and the task files")
    action.add_argument("--serve", action="store_true", help=f"serve local/site on {SHOP_ORIGIN} until Ctrl-C")
    parser.add_argument("--port", type=int, default=SHOP_PORT, help=f"--serve: port (default {SHOP_PORT})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.check:
        stale = stale_files()
        for path in stale:
            print(f"stale: {path}")
        print("up to date" if not stale else f"{len(stale)} stale file(s); run with --write")
        return 1 if stale else 0
    if args.write:
        SHOP_DIR.mkdir(parents=True, exist_ok=True)
        for path in sorted(set(SHOP_DIR.glob("*.html")) - set(rendered_files())):
            path.unlink()
        for path, text in rendered_files().items():
            path.write_text(text, encoding="utf-8")
        task_files = ", ".join(path.name for pair in SUITE_FILES.values() for path in pair)
        print(f"wrote {len(render_pages())} pages to {SHOP_DIR} and the task files {task_files} to {EXAMPLES_DIR}")
        return 0
    with serve(args.port) as site:
        print(f"serving {SITE_DIR} at {site.url}/{SHOP_FOLDER}/index.html; Ctrl-C stops", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
