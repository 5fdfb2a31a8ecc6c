"""The pages the in-process environment server's browsers load, and how a page renders as an observation.

Owns the site model (a :class:`Site` maps URLs to :class:`Page` values and their :class:`Element` values;
:meth:`Site.bundled` is the real server's own ``site/`` folder) and the simulated browser (:class:`Browser`):
navigation, element ids bound by the latest observation, clicks, typing, the ``browser_finish`` snapshot, and every
browser error with the text Playwright 1.62 and Chromium give it. :meth:`Observation.render` is the real server's
observation format at its caps (elements listed up to ``max_elements``, names cut at 80 characters, body text folded
and cut at 2000); the contract it belongs to is stated in :mod:`~nemo_gym_browser.local.environment_server.server`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from urllib.parse import urljoin, urlsplit, urlunsplit

from ..faults.kinds import goto_call_log

__all__ = [
    "BUNDLED_INITIAL_URL",
    "BUNDLED_ROOT",
    "BUNDLED_VERIFIER_METADATA",
    "DEFAULT_MAX_ELEMENTS",
    "Browser",
    "Element",
    "Error",
    "Observation",
    "Page",
    "PageState",
    "Site",
    "TargetClosedError",
    "button",
    "link",
    "text_input",
]

# A relative initial_url resolves under the real server's folder; this is where the model pretends it lives.
BUNDLED_ROOT = "file:///nemo_gym/resources_servers/interactive_browser/"
# The example episode of the real server's own data/example.jsonl (first row).
BUNDLED_INITIAL_URL = "site/index.html"
BUNDLED_VERIFIER_METADATA: Mapping[str, str] = {"url_contains": "about.html"}
# Body text budget per observation (browser/page.py).
_MAX_TEXT_CHARS = 2000
_ELEMENT_NAME_CHARS = 80
DEFAULT_MAX_ELEMENTS = 50
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.\-]*:")

_TARGET_CLOSED = "Target page, context or browser has been closed"
# Ports Chromium refuses to connect to (net::ERR_UNSAFE_PORT), checked against Debian's Chromium.
_UNSAFE_PORTS = frozenset(
    {1, 7, 9, 11, 13, 15, 17, 19, 20, 21, 22, 23, 25, 37, 42, 43, 53, 69, 77, 79, 87, 95, 101, 102, 103, 104, 109, 110}
    | {111, 113, 115, 117, 119, 123, 135, 137, 139, 143, 161, 179, 389, 427, 465, 512, 513, 514, 515, 526, 530, 531}
    | {532, 540, 548, 554, 556, 563, 587, 601, 636, 989, 990, 993, 995, 1719, 1720, 1723, 2049, 3659, 4045, 5060}
    | {5061, 6000, 6566, 6665, 6666, 6667, 6668, 6669, 6697, 10080}
)


@dataclass
class PageState:
    """The live state of the page a session is on; what an ``on_click`` callback may read and change."""

    url: str
    title: str
    values: dict[str, str] = field(default_factory=dict)

    def value(self, key: str) -> str:
        """What was typed into the input with this ``key`` ("" when nothing was)."""
        return self.values.get(key, "")


@dataclass(frozen=True)
class Element:
    """One interactive element, in DOM order.

    ``tag`` is what the observation shows (the lower-case tag name: ``a``, ``button``, ``input``, ...); ``name`` is
    its visible text or ``value`` attribute. A click on an element with ``href`` navigates there (relative to the
    page); otherwise ``on_click`` runs and may return a URL to navigate to. ``input`` and ``textarea`` accept
    typing, stored under ``key``. Invisible elements are never listed.
    """

    tag: str
    name: str = ""
    href: str | None = None
    on_click: Callable[[PageState], str | None] | None = None
    key: str | None = None
    visible: bool = True

    @property
    def fillable(self) -> bool:
        return self.tag in ("input", "textarea")


def link(name: str, href: str) -> Element:
    return Element(tag="a", name=name, href=href)


def button(name: str, on_click: Callable[[PageState], str | None] | None = None) -> Element:
    return Element(tag="button", name=name, on_click=on_click)


def text_input(key: str, value: str = "") -> Element:
    """An ``<input id=key>``; ``value`` is its value *attribute*, the only value the element list ever shows."""
    return Element(tag="input", name=value, key=key)


@dataclass(frozen=True)
class Page:
    """A page: its title, the text ``innerText`` of ``<body>`` gives (link and button labels included, raw
    newlines kept: ``dom_contains`` grades the raw text), and its interactive elements in DOM order."""

    title: str
    text: str = ""
    elements: tuple[Element, ...] = ()


_BLANK = Page(title="")


def _welcome(page: PageState) -> None:
    # form.html's button: onclick="document.title='Welcome '+document.getElementById('user').value"
    page.title = "Welcome " + page.value("user")


class Site:
    """The pages the simulated browser can load, keyed by absolute URL. Anything else fails like an unreachable host.

    ``root`` is the folder a relative ``initial_url`` resolves under (the real server's own folder).
    """

    def __init__(self, pages: Mapping[str, Page], *, root: str = BUNDLED_ROOT) -> None:
        self.root = root if root.endswith("/") else root + "/"
        self._pages = {_normalise_url(url): page for url, page in pages.items()}

    @classmethod
    def bundled(cls, *, root: str = BUNDLED_ROOT) -> Site:
        """The real server's ``site/`` folder: index.html links to form.html and about.html."""
        base = (root if root.endswith("/") else root + "/") + "site/"
        return cls(
            {
                base + "index.html": Page(
                    title="Home",
                    text="Lexmount Test Home\nGo to form About",
                    elements=(link("Go to form", "form.html"), link("About", "about.html")),
                ),
                base + "about.html": Page(title="About", text="About Lexmount\n\nSecret code: ALPHA-42"),
                base + "form.html": Page(
                    title="Form",
                    text="Login Form\n Submit",
                    elements=(text_input("user"), button("Submit", on_click=_welcome)),
                ),
            },
            root=root,
        )

    def with_pages(self, pages: Mapping[str, Page]) -> Site:
        """This site plus (or overriding) ``pages``."""
        return Site({**self._pages, **pages}, root=self.root)

    def resolve_initial_url(self, initial_url: str) -> str:
        """A URL without a scheme is a path under the server folder (``Path(app.py).parent / url``)."""
        if initial_url and not _SCHEME.match(initial_url):
            return (PurePosixPath(urlsplit(self.root).path) / initial_url).as_uri()
        return initial_url

    def page(self, url: str) -> Page | None:
        if url.startswith("about:"):  # about:blank, and any other about: URL, is an empty page
            return _BLANK
        return self._pages.get(url) or self._pages.get(url.partition("#")[0])

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(self._pages)


def _navigable(url: str) -> bool:
    """Whether Chromium accepts the URL at all (it refuses one without a scheme or with a bad port)."""
    if not _SCHEME.match(url):
        return False
    try:
        urlsplit(url).port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError:
        return False
    return True


def _normalise_url(url: str) -> str:
    """What Chromium and Playwright's ``new URL(...)`` report for a URL: lower-case scheme and host, ``/`` for an
    empty http(s) path, spaces in the path, query and fragment as ``%20``."""
    if not _SCHEME.match(url) or url.startswith("about:"):
        return url
    parts = urlsplit(url)
    path = parts.path or ("/" if parts.scheme in ("http", "https") else "")
    path, query, fragment = (part.replace(" ", "%20") for part in (path, parts.query, parts.fragment))
    return urlunsplit((parts.scheme.lower(), parts.netloc.lower(), path, query, fragment))


# ----------------------------------------------------------------------------------------------------------------
# The simulated browser (errors and their texts as Playwright 1.62 + Chromium report them)
# ----------------------------------------------------------------------------------------------------------------


class Error(Exception):
    """A browser error, named like Playwright's: its ``repr`` (``Error('Page.goto: ...')``) is a 500 body."""


class TargetClosedError(Error):
    pass


def _error_page(url: str) -> tuple[str, Page]:
    """The Chromium error page a failed navigation lands on, and the net error code."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        text = "Your file couldn’t be accessed\n\nIt may have been moved, edited, or deleted.\n\nERR_FILE_NOT_FOUND"
        return "net::ERR_FILE_NOT_FOUND", Page(title=url, text=text)
    host = parts.hostname or ""
    if parts.port in _UNSAFE_PORTS:  # checked before any lookup, for every host
        what = f"The webpage at {url} might be temporarily down or it may have moved permanently to a new web address."
        return "net::ERR_UNSAFE_PORT", Page(title=host, text=f"This site can’t be reached\n\n{what}\n\nERR_UNSAFE_PORT")
    if host == "localhost" or re.fullmatch(r"[0-9.]+|\[?[0-9a-fA-F:]+\]?", host):
        code, what, hint = (
            "ERR_CONNECTION_REFUSED",
            f"{host} refused to connect.",
            "Checking the proxy and the firewall",
        )
    else:
        code, what = "ERR_NAME_NOT_RESOLVED", f"{host}’s server IP address could not be found."
        hint = "Checking the proxy, firewall, and DNS configuration"
    text = f"This site can’t be reached\n\n{what}\n\nTry:\n\nChecking the connection\n{hint}\n{code}\nReload\nDetails"
    elements = (Element(tag="a", name=hint), button("Reload"), button("Details"))
    return f"net::{code}", Page(title=host, text=text, elements=elements)


@dataclass(frozen=True)
class Observation:
    """What one observation saw; :meth:`render` writes it as the real server's tools answer it."""

    url: str
    title: str
    elements: tuple[tuple[int, str, str], ...]
    text: str
    truncated: bool
    text_truncated: bool

    def render(self, max_elements: int) -> str:
        lines = [f"URL: {self.url}", f"TITLE: {self.title}", "ELEMENTS:"]
        lines += [f"  [{eid}] {tag}: {name}" for eid, tag, name in self.elements[:max_elements]]
        if self.truncated or len(self.elements) > max_elements:
            lines.append(f"  ... (truncated at {max_elements} elements)")
        if self.text:
            lines += ["TEXT:", f"  {self.text}"]
            if self.text_truncated:
                lines.append("  ... (truncated)")
        return "\n".join(lines)


class Browser:
    """One session's page. Element ids bind to (page load, position on the page) at each observation."""

    def __init__(self, site: Site) -> None:
        self._site = site
        self._page = _BLANK
        self._state = PageState(url="about:blank", title="")
        self._load = 0
        self._bound: dict[int, tuple[int, int]] = {}
        self.crashed = False

    def _load_page(self, url: str, page: Page) -> None:
        self._page, self._state, self._load = page, PageState(url=url, title=page.title), self._load + 1

    def _check_alive(self, api: str) -> None:
        if self.crashed:
            raise TargetClosedError(f"{api}: {_TARGET_CLOSED}")

    def goto(self, url: str) -> None:
        self._check_alive("Page.goto")
        if not _navigable(url):
            raise Error(goto_call_log("Page.goto: Protocol error (Page.navigate): Cannot navigate to invalid URL", url))
        url = _normalise_url(url)
        page = self._site.page(url)
        if page is None:
            code, error_page = _error_page(url)
            self._load_page("chrome-error://chromewebdata/", error_page)
            raise Error(goto_call_log(f"Page.goto: {code} at {url}", url))
        self._load_page(url, page)

    def observe(self, max_elements: int) -> Observation:
        self._check_alive("Locator.count")
        self._bound.clear()
        listed: list[tuple[int, str, str]] = []
        truncated = False
        for position, element in enumerate(self._page.elements):
            if len(listed) >= max_elements:
                truncated = True
                break
            if not element.visible:
                continue
            eid = len(listed)
            self._bound[eid] = (self._load, position)
            listed.append((eid, element.tag, " ".join(element.name.split())[:_ELEMENT_NAME_CHARS]))
        folded = " ".join(self._page.text.split())
        return Observation(
            url=self._state.url,
            title=" ".join(self._state.title.split()),  # document.title strips and folds whitespace
            elements=tuple(listed),
            text=folded[:_MAX_TEXT_CHARS],
            truncated=truncated,
            text_truncated=len(folded) > _MAX_TEXT_CHARS,
        )

    def _require(self, element_id: int, api: str, detached_log: str) -> tuple[int, Element]:
        if element_id not in self._bound:  # KeyError: the real message arrives quoted ("click failed: 'element_id")
            raise KeyError(f"element_id {element_id} not in last observation; call browser_observe first")
        load, position = self._bound[element_id]
        self._check_alive(api)
        if load != self._load:
            raise Error(f"{api}: Element is not attached to the DOM\nCall log:\n{detached_log}")
        return position, self._page.elements[position]

    def click(self, element_id: int) -> None:
        _, element = self._require(
            element_id,
            "ElementHandle.click",
            "  - attempting click action\n    - waiting for element to be visible, enabled and stable\n",
        )
        target = element.href
        if target is None and element.on_click is not None:
            target = element.on_click(self._state)
        if target is not None:
            url = _normalise_url(urljoin(self._state.url, target))
            page = self._site.page(url)
            if page is None:  # a link to nowhere: the click succeeds, the page becomes an error page
                _, page = _error_page(url)
                url = "chrome-error://chromewebdata/"
            self._load_page(url, page)

    def type(self, element_id: int, text: str) -> None:
        fill_log = (
            f'    - fill("{text}")\n'
            "  - attempting fill action\n    - waiting for element to be visible, enabled and editable\n"
        )
        position, element = self._require(element_id, "ElementHandle.fill", fill_log)
        if not element.fillable:
            raise Error(
                "ElementHandle.fill: Error: Element is not an <input>, <textarea>, <select> or [contenteditable] "
                f"and does not have a role allowing [aria-readonly]\nCall log:\n{fill_log}"
            )
        self._state.values[element.key or f"#{position}"] = text

    def current_url(self) -> str:
        return self._state.url  # Playwright caches page.url: readable even after a crash

    def raw_text(self) -> str:
        return "" if self.crashed else self._page.text  # the real driver swallows errors here

    def finish_snapshot(self) -> tuple[str, str]:
        """What ``browser_finish`` records: observe(max_elements=0) unbinds every id, then URL and title + text."""
        observation = self.observe(0)
        return self.current_url(), observation.title + " " + self.raw_text()
