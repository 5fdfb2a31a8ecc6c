"""In-process fake of NeMo Gym 0.7.0's ``interactive_browser`` resources server, with faults on demand.

The fake speaks the wire contract of the real server (``resources_servers/interactive_browser/app.py`` on top of
``nemo_gym``'s FastAPI resources server) as far as a client can observe it, and replaces the browser with a small
in-memory site model. Facts it keeps, each read off the 0.7.0 source or measured against it:

- **Sessions** ride on the Starlette session cookie ``InteractiveBrowserResourcesServer___interactive_browser``
  (``path=/; Max-Age=1209600; httponly; samesite=lax``), re-sent on every non-500 answer. A request without it
  gets a fresh empty session. The cookie carries the session id itself, so it survives a server restart (the
  browser behind it does not). A typed close clears the cookie (``expires=Thu, 01 Jan 1970 ...``).
- **Seed** ``POST /seed_session``: the typed body (``resources_session_id``, ``episode_id``, ``task_id``,
  ``task_data``; extra keys forbidden) answers ``{"resources_session_id": id, "resources_tools": null,
  "sandbox_access": null}``; any other JSON object is the legacy body and answers ``{}`` under the cookie's id.
  A typed seed repeated for the same episode and task is idempotent; for another one, or for a closed id, 500.
  A relative ``initial_url`` resolves under the server folder (``file://``); a start page that fails to load is a
  500 whose body is the ``repr`` of the browser error, and no session is opened.
- **Tools** ``POST /browser_observe|navigate|click|type|finish`` answer ``{"observation", "done", "error"}`` with
  HTTP 200 for every page-level failure (``"<verb> failed: <browser error>"``) and for a missing session
  (``"no active session; seed_session must be called first"``); bad arguments answer FastAPI's 422
  ``{"detail": [{"type", "loc": ["body", ...], "msg", "input"}]}``. The observation is::

      URL: <url>
      TITLE: <title>
      ELEMENTS:
        [<id>] <tag>: <name>
        ... (truncated at <max_elements> elements)
      TEXT:
        <page text, whitespace folded, at most 2000 chars>
        ... (truncated)

  (``TEXT`` only when the page has text.) Element ids are bound by the latest observation; every successful tool
  re-observes, ``browser_finish`` unbinds them all, and a failed navigation leaves the old ids pointing at a
  detached page. The first ``browser_finish`` wins and snapshots the URL and ``title + " " + raw text``.
- **Verify** ``POST /verify`` needs ``responses_create_params`` and ``response`` (422 otherwise) and grades with the
  ``verifier_metadata`` stored at seed: ``answer_equals``, else ``final_url``, else ``url_contains``, else
  ``dom_contains`` (case-insensitive). No supported key: 500, after releasing the browser. Verify always releases
  the browser; a session that is gone answers reward 0.0, ``mask_sample: false``, ``failure_reason`` "browser
  session not found at verify"; a crashed browser answers "browser unreachable while scoring: ...".
- **Close** ``POST /close_session`` with ``{"resources_session_id", "episode_id"}`` releases the browser and
  remembers the id as closed (answers ``{"resources_session_id": id}``, idempotent); an empty body releases the
  cookie's session and answers ``{"closed": true}``; a malformed typed body is a 422 without the ``body`` prefix.
- ``GET /``, ``/health``, ``/healthz``, ``/livez``, ``/readyz`` answer ``{"status": "ok"}``; unknown paths 404.

What it does not model: the items inside the Responses API objects are not validated (the real server checks
them against OpenAI's types; the echo in the verify answer has the same fields and defaults); ``/aggregate_metrics``
and ``/reverify_mode`` are absent; the browser is a page table (:class:`Site`), not Chromium.

Faults (deterministic): every :class:`~nemo_gym_browser.testing.faults.Fault` kind, from inside the server (see
:mod:`~nemo_gym_browser.testing.faults` for what each does), by :meth:`FakeEnvironmentServer.inject` per endpoint or
``"*"`` (optionally for one session, from the Nth matching call, for ``times`` calls) or per request by a rule
(:meth:`~FakeEnvironmentServer.set_rule`, the same kind of rule the fault proxy takes). Besides those:

- connection refused: :meth:`~FakeEnvironmentServer.stop`, then :meth:`~FakeEnvironmentServer.start` on the same
  port (or ``async with server.refusing_connections():``); a server killed and restarted:
  :meth:`~FakeEnvironmentServer.restart`; :meth:`~FakeEnvironmentServer.lose_session` and
  :meth:`~FakeEnvironmentServer.crash_browser` at any moment;
- ``latency_s`` / :meth:`~FakeEnvironmentServer.set_latency`: a fixed delay before every call (benchmarks).

Bookkeeping for leak tests: :meth:`~FakeEnvironmentServer.events` (per session: ``["seed", "observe", ...,
"verify", "close"]``, every call received), :attr:`~FakeEnvironmentServer.open_sessions` (browsers seeded and not
released by verify, close or a legacy re-seed), :attr:`~FakeEnvironmentServer.orphaned_browsers` (seeds cancelled
while ``browser_open_s`` was running: the real server strands those browsers).

Example::

    async with FakeEnvironmentServer() as server:
        server.inject("browser_click", Fault.status(503), on_call=2)
        ...  # drive http://127.0.0.1:<port> with CookieJar(unsafe=True)
        assert server.events(session_id) == ["seed", "observe", "click", "click", "verify", "close"]
        assert server.open_sessions == 0
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urljoin, urlsplit, urlunsplit

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter, ValidationError, field_validator

from .background_loop import BackgroundLoop
from .faults import Fault, Rule, SeenRequest, canned_answer, drop_connection, goto_call_log, hold, with_reward
from .loopback import LoopbackServer

logger = logging.getLogger(__name__)

__all__ = [
    "BUNDLED_INITIAL_URL",
    "BUNDLED_ROOT",
    "BUNDLED_VERIFIER_METADATA",
    "COOKIE_NAME",
    "NO_SESSION_ERROR",
    "SESSION_NOT_FOUND_AT_VERIFY",
    "Element",
    "FakeEnvironmentServer",
    "FaultRule",
    "Page",
    "PageState",
    "Site",
    "ThreadedFakeEnvironment",
    "button",
    "link",
    "text_input",
]

# ----------------------------------------------------------------------------------------------------------------
# Contract constants (from the 0.7.0 source)
# ----------------------------------------------------------------------------------------------------------------

# `<ServerClassName>___<server instance name>`: nemo_gym's session-middleware key, also the cookie name.
COOKIE_NAME = "InteractiveBrowserResourcesServer___interactive_browser"
# Starlette's SessionMiddleware default lifetime (14 days) and cookie flags.
_COOKIE_MAX_AGE_S = 14 * 24 * 60 * 60
_COOKIE_EXPIRED = "Thu, 01 Jan 1970 00:00:00 GMT"
_SESSION_ID_KEY = "session_id"

NO_SESSION_ERROR = "no active session; seed_session must be called first"
SESSION_NOT_FOUND_AT_VERIFY = "browser session not found at verify"
# As the real "no supported scoring key" message lists them (grading tries answer_equals first).
_SCORING_KEYS_IN_MESSAGE = ("final_url", "url_contains", "dom_contains", "answer_equals")
# Body text budget per observation (browser/page.py).
_MAX_TEXT_CHARS = 2000
_ELEMENT_NAME_CHARS = 80
DEFAULT_MAX_ELEMENTS = 50
# uvicorn's keep-alive as nemo_gym configures it: clients must keep theirs below it.
_SERVER_KEEPALIVE_S = 30.0
# uvicorn sets no body limit; aiohttp's default (1 MiB) would turn a long rollout's verify body into a 413.
_MAX_REQUEST_BYTES = 256 * 1024 * 1024
# A relative initial_url resolves under the real server's folder; this is where the fake pretends it lives.
BUNDLED_ROOT = "file:///nemo_gym/resources_servers/interactive_browser/"
# The example episode of the real server's own data/example.jsonl (first row).
BUNDLED_INITIAL_URL = "site/index.html"
BUNDLED_VERIFIER_METADATA: Mapping[str, str] = {"url_contains": "about.html"}

_LIVENESS_PATHS = frozenset({"/", "/health", "/healthz", "/livez", "/readyz"})
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.\-]*:")
_TARGET_CLOSED = "Target page, context or browser has been closed"
# Ports Chromium refuses to connect to (net::ERR_UNSAFE_PORT), checked against Debian's Chromium.
_UNSAFE_PORTS = frozenset(
    {1, 7, 9, 11, 13, 15, 17, 19, 20, 21, 22, 23, 25, 37, 42, 43, 53, 69, 77, 79, 87, 95, 101, 102, 103, 104, 109, 110}
    | {111, 113, 115, 117, 119, 123, 135, 137, 139, 143, 161, 179, 389, 427, 465, 512, 513, 514, 515, 526, 530, 531}
    | {532, 540, 548, 554, 556, 563, 587, 601, 636, 989, 990, 993, 995, 1719, 1720, 1723, 2049, 3659, 4045, 5060}
    | {5061, 6000, 6566, 6665, 6666, 6667, 6668, 6669, 6697, 10080}
)


# ----------------------------------------------------------------------------------------------------------------
# Wire models (field names, constraints and class names as in nemo_gym 0.7.0: they appear in 422 `loc`s)
# ----------------------------------------------------------------------------------------------------------------


class EpisodeId(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rollout_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    attempt: int = Field(default=0, ge=0)

    @field_validator("rollout_id")
    @classmethod
    def _reserve_attempt_suffix(cls, rollout_id: str) -> str:
        if re.search(r"-a[1-9][0-9]*$", rollout_id):
            raise ValueError("rollout_id must not end with the reserved attempt suffix '-a<N>'")
        return rollout_id


class TaskId(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    taskset: str = Field(min_length=1)
    task_id: str = Field(min_length=1)


class ResourcesSeedSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    resources_session_id: str = Field(min_length=1)
    episode_id: EpisodeId
    task_id: TaskId
    task_data: dict[str, JsonValue]


class BrowserSeedSessionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    initial_url: str = "about:blank"
    verifier_metadata: dict[str, Any] | None = None


class ResourcesCloseSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    resources_session_id: str
    episode_id: EpisodeId


class NavigateRequest(BaseModel):
    url: str


class ElementRequest(BaseModel):
    element_id: int


class TypeRequest(BaseModel):
    element_id: int
    text: str


class FinishRequest(BaseModel):
    answer: str = ""


class ToolResponse(BaseModel):
    observation: str
    done: bool = False
    error: str | None = None


class NeMoGymResponseCreateParamsNonStreaming(BaseModel):
    """The request half of a rollout: nemo_gym's field names, order and defaults (extra keys forbidden); the
    values themselves are not checked as deeply as the real model does."""

    model_config = ConfigDict(extra="forbid")

    background: Any = None
    include: Any = None
    input: str | list[Any]
    instructions: Any = None
    max_output_tokens: Any = None
    max_tool_calls: Any = None
    metadata: Any = None
    model: Any = None
    parallel_tool_calls: bool = True
    previous_response_id: Any = None
    prompt: Any = None
    reasoning: Any = None
    service_tier: Any = None
    store: Any = None
    context_management: Any = None
    conversation: Any = None
    moderation: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    safety_identifier: Any = None
    stream_options: Any = None
    temperature: Any = None
    text: Any = None
    tool_choice: Any = "auto"
    tools: list[Any] = Field(default_factory=list)
    top_logprobs: Any = None
    top_p: Any = None
    truncation: Any = None
    user: Any = None
    stream: Literal[False] | None = None


class NeMoGymResponse(BaseModel):
    """The response half: OpenAI's ``Response`` (openai 2.44) field names, order and required fields."""

    model_config = ConfigDict(extra="allow")

    id: str
    created_at: float
    error: Any = None
    incomplete_details: Any = None
    instructions: Any = None
    metadata: Any = None
    model: str
    object: Literal["response"]
    output: list[Any]
    parallel_tool_calls: bool
    temperature: Any = None
    tool_choice: Any
    tools: list[Any]
    top_p: Any = None
    background: Any = None
    completed_at: Any = None
    conversation: Any = None
    max_output_tokens: Any = None
    max_tool_calls: Any = None
    moderation: Any = None
    previous_response_id: Any = None
    prompt: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    reasoning: Any = None
    safety_identifier: Any = None
    service_tier: Any = None
    status: Any = None
    text: Any = None
    top_logprobs: Any = None
    truncation: Any = None
    usage: Any = None
    user: Any = None


class BrowserVerifyRequest(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    responses_create_params: NeMoGymResponseCreateParamsNonStreaming
    response: NeMoGymResponse
    capture_rollout_id: str | None = Field(default=None, alias="_ng_rollout_id", exclude=True)
    verifier_metadata: dict[str, Any] | None = None


# Typed first and left to right, like the real handler: the legacy model allows extras and would swallow it.
_SEED_BODY = TypeAdapter(
    Annotated[ResourcesSeedSessionRequest | BrowserSeedSessionRequest, Field(union_mode="left_to_right")]
)
_CLOSE_BODY = TypeAdapter(dict[str, Any] | None)
_NAVIGATE_BODY = TypeAdapter(NavigateRequest)
_ELEMENT_BODY = TypeAdapter(ElementRequest)
_TYPE_BODY = TypeAdapter(TypeRequest)
_FINISH_BODY = TypeAdapter(FinishRequest)
_VERIFY_BODY = TypeAdapter(BrowserVerifyRequest)


# ----------------------------------------------------------------------------------------------------------------
# Site model
# ----------------------------------------------------------------------------------------------------------------


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
    """The pages the fake browser can load, keyed by absolute URL. Anything else fails like an unreachable host.

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
    """What Chromium reports for a URL: lower-case scheme and host, ``/`` for an empty http(s) path."""
    if not _SCHEME.match(url) or url.startswith("about:"):
        return url
    parts = urlsplit(url)
    path = parts.path or ("/" if parts.scheme in ("http", "https") else "")
    return urlunsplit((parts.scheme.lower(), parts.netloc.lower(), path, parts.query, parts.fragment))


# ----------------------------------------------------------------------------------------------------------------
# The fake browser (errors and their texts as Playwright 1.62 + Chromium report them)
# ----------------------------------------------------------------------------------------------------------------


class Error(Exception):
    """A browser error, named like Playwright's: its ``repr`` (``Error('Page.goto: ...')``) is a 500 body."""


class TargetClosedError(Error):
    pass


class _ScoringUnavailable(RuntimeError):
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
class _Observation:
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


class _Browser:
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

    def observe(self, max_elements: int) -> _Observation:
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
        return _Observation(
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


@dataclass
class _SessionState:
    browser: _Browser
    gt: dict[str, Any]
    answer: str | None = None
    finished_url: str | None = None
    finished_text: str | None = None

    @property
    def finished(self) -> bool:
        return self.finished_url is not None


# ----------------------------------------------------------------------------------------------------------------
# Faults
# ----------------------------------------------------------------------------------------------------------------

# Endpoint name -> event name in the per-session log.
_ENDPOINTS: Mapping[str, str] = {
    "seed_session": "seed",
    "close_session": "close",
    "verify": "verify",
    "browser_observe": "observe",
    "browser_navigate": "navigate",
    "browser_click": "click",
    "browser_type": "type",
    "browser_finish": "finish",
}


@dataclass
class _Call:
    """One request as the fake sees it: endpoint, raw body, and the cookie session (mutated by handlers)."""

    endpoint: str
    raw: bytes
    content_type: str | None
    cookie_session: dict[str, str]
    had_cookie_session: bool
    session_id: str = ""
    parsed: Any = None

    @property
    def cookie_session_id(self) -> str:
        return self.cookie_session[_SESSION_ID_KEY]


@dataclass
class FaultRule:
    """One injected fault. Counts its own matching calls; ``fired`` says how often it acted."""

    endpoint: str
    fault: Fault
    on_call: int | None = None
    times: int | None = None
    session_id: str | None = None
    seen: int = 0
    fired: int = 0

    def matches(self, endpoint: str, session_id: str) -> bool:
        return self.endpoint in ("*", endpoint) and self.session_id in (None, session_id)

    @property
    def due(self) -> bool:
        """Whether the call just counted in ``seen`` falls in this rule's window."""
        first = self.on_call or 1
        return self.seen >= first and (self.times is None or self.seen < first + self.times)


def _endpoint_name(endpoint: str) -> str:
    name = endpoint.lstrip("/")
    if name != "*" and name not in _ENDPOINTS:
        raise ValueError(f"unknown endpoint {endpoint!r}; expected '*' or one of {sorted(_ENDPOINTS)}")
    return name


# ----------------------------------------------------------------------------------------------------------------
# Request plumbing: FastAPI's body parsing and validation errors, Starlette's session cookie
# ----------------------------------------------------------------------------------------------------------------


class _Unprocessable(Exception):
    """Answer 422 with FastAPI's ``{"detail": errors}``."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("422")
        self.errors = errors


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, BaseException):
        return {}  # FastAPI's jsonable_encoder turns an exception in `ctx` into {}
    return value


def _request_errors(exc: ValidationError, prefix: tuple[str, ...]) -> list[dict[str, Any]]:
    return [_jsonable({**err, "loc": [*prefix, *err["loc"]]}) for err in exc.errors(include_url=False)]


_Model = TypeVar("_Model")


def _parse_body(call: _Call, adapter: TypeAdapter[_Model], *, required: bool) -> _Model:
    """FastAPI's handling of a single body parameter: JSON only for a JSON content type, 422s shaped like its own."""
    body: Any = None
    if call.raw:
        media = (call.content_type or "").split(";")[0].strip().lower()
        if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
            try:
                body = json.loads(call.raw)
            except json.JSONDecodeError as exc:
                raise _Unprocessable(
                    [
                        {
                            "type": "json_invalid",
                            "loc": ["body", exc.pos],
                            "msg": "JSON decode error",
                            "input": {},
                            "ctx": {"error": exc.msg},
                        }
                    ]
                ) from exc
        else:
            body = call.raw
    if body is None and required:
        raise _Unprocessable([{"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}])
    try:
        return adapter.validate_python(body, from_attributes=True)  # as FastAPI validates a body
    except ValidationError as exc:
        raise _Unprocessable(_request_errors(exc, ("body",))) from exc


class _CookieCodec:
    """A signed, opaque cookie value carrying the session dict, like Starlette's (which survives restarts too)."""

    def __init__(self, secret: str) -> None:
        self._key = secret.encode()

    def _sign(self, payload: str) -> str:
        return hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()[:24]

    def encode(self, session: Mapping[str, str]) -> str:
        payload = base64.urlsafe_b64encode(json.dumps(dict(session)).encode()).decode().rstrip("=")
        return f"{payload}.{self._sign(payload)}"

    def decode(self, value: str | None) -> dict[str, str]:
        if not value or "." not in value:
            return {}
        payload, signature = value.rsplit(".", 1)
        if not hmac.compare_digest(signature, self._sign(payload)):
            return {}
        try:
            session = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        except (ValueError, json.JSONDecodeError):
            return {}
        return session if isinstance(session, dict) else {}


def _json_response(payload: Any, status: int = 200) -> web.Response:
    # Starlette's JSONResponse rendering.
    text = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return web.Response(status=status, text=text, content_type="application/json")


# ----------------------------------------------------------------------------------------------------------------
# The server
# ----------------------------------------------------------------------------------------------------------------


class FakeEnvironmentServer(LoopbackServer):
    """An aiohttp server on 127.0.0.1 that answers like a NeMo Gym 0.7.0 ``interactive_browser`` server.

    ``site``: the pages its browsers can load (default: the real server's bundled ``site/``). ``max_elements``:
    the server's element cap. ``latency_s``: a fixed delay before every call (benchmarks). ``browser_open_s``: how
    long a seed spends opening the browser; a seed cancelled during it leaves an orphaned browser, as the real
    server does (counted in :attr:`orphaned_browsers`). ``port``: 0 picks a free one, kept across restarts.

    Lifetime (:class:`~nemo_gym_browser.testing.loopback.LoopbackServer`): ``start`` listens, ``stop`` cuts every
    connection and keeps the sessions unless told to lose them, ``close`` (and leaving ``async with``) is ``stop``.
    """

    description = "the fake environment server"

    def __init__(
        self,
        site: Site | None = None,
        *,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
        latency_s: float = 0.0,
        browser_open_s: float = 0.0,
        port: int = 0,
    ) -> None:
        self.site = site if site is not None else Site.bundled()
        self.max_elements = max_elements
        self.latency_s = latency_s
        self.browser_open_s = browser_open_s
        super().__init__(port=port)
        self.orphaned_browsers = 0
        self._cookies = _CookieCodec(COOKIE_NAME)
        self._states: dict[str, _SessionState] = {}
        self._typed_identity: dict[str, tuple[EpisodeId, TaskId]] = {}
        self._typed_closed: dict[str, EpisodeId] = {}
        self._typed_locks: dict[str, asyncio.Lock] = {}
        self._events: dict[str, list[str]] = {}
        self._calls: dict[str, int] = dict.fromkeys(_ENDPOINTS, 0)
        self._latency: dict[str, float] = {}
        self._rules: list[FaultRule] = []
        self._rule: Rule | None = None
        self._handlers: Mapping[str, Callable[[_Call], Coroutine[Any, Any, web.Response]]] = {
            "seed_session": self._seed_session,
            "close_session": self._close_session,
            "verify": self._verify,
            "browser_observe": self._browser_observe,
            "browser_navigate": self._browser_navigate,
            "browser_click": self._browser_click,
            "browser_type": self._browser_type,
            "browser_finish": self._browser_finish,
        }

    # ----- lifetime -------------------------------------------------------------------------------------------

    def _application(self) -> web.Application:
        app = web.Application(client_max_size=_MAX_REQUEST_BYTES)
        app.router.add_route("*", "/{path:.*}", self._dispatch)
        return app

    def _runner_options(self) -> dict[str, Any]:
        return {"keepalive_timeout": _SERVER_KEEPALIVE_S}

    async def stop(self, *, lose_state: bool = False) -> None:
        """Close the port and every open connection (in-flight requests are cut off). Idempotent.

        ``lose_state=True`` also forgets every session, as a killed server process does; without it the sessions
        are there again after :meth:`start` (a network outage rather than a crash).
        """
        await super().stop()
        if lose_state:
            self._forget_everything()

    async def restart(self) -> None:
        """A server killed and started again on the same port: every session is gone, cookies still decode."""
        await self.stop(lose_state=True)
        await self.start()

    @contextlib.asynccontextmanager
    async def refusing_connections(self) -> AsyncIterator[FakeEnvironmentServer]:
        """Inside the block the port is closed (connection refused); sessions survive."""
        await self.stop()
        try:
            yield self
        finally:
            await self.start()

    def run_in_thread(self) -> ThreadedFakeEnvironment:
        """Run this server on its own event loop in a daemon thread, for synchronous code."""
        return ThreadedFakeEnvironment(self)

    # ----- inspection -----------------------------------------------------------------------------------------

    @property
    def open_sessions(self) -> int:
        """Browsers seeded and not yet released (by verify, close, or a legacy re-seed)."""
        return len(self._states)

    @property
    def open_session_ids(self) -> tuple[str, ...]:
        return tuple(self._states)

    def events(self, session_id: str) -> list[str]:
        """Every call this server received for the session, in order: "seed", "observe", ..., "verify", "close"."""
        return list(self._events.get(session_id, ()))

    @property
    def session_ids(self) -> tuple[str, ...]:
        """Every session id a call was attributed to, in first-seen order."""
        return tuple(self._events)

    def calls(self, endpoint: str = "*") -> int:
        """How many requests reached ``endpoint`` (all endpoints for ``"*"``)."""
        name = _endpoint_name(endpoint)
        return sum(self._calls.values()) if name == "*" else self._calls[name]

    # ----- fault injection ------------------------------------------------------------------------------------

    def inject(
        self,
        endpoint: str,
        fault: Fault,
        *,
        on_call: int | None = None,
        times: int | None = None,
        session_id: str | None = None,
    ) -> FaultRule:
        """Make ``endpoint`` (``"browser_click"``, ``"/verify"``, or ``"*"``) misbehave.

        Every rule counts the requests it matches (endpoint, and ``session_id`` when given) from the moment it is
        added. It is due from its ``on_call``-th match on (default: the first) for ``times`` matches (default: 1
        with ``on_call``, otherwise forever). When several rules are due, the one added first acts and the others
        let that call pass; the rule of :meth:`set_rule` is asked only about calls no injected fault acts on. The
        per-call latency applies before any of them.
        """
        if on_call is not None and on_call < 1:
            raise ValueError("on_call counts from 1")
        if times is not None and times < 1:
            raise ValueError("times must be at least 1")
        rule = FaultRule(
            endpoint=_endpoint_name(endpoint),
            fault=fault,
            on_call=on_call,
            times=1 if (times is None and on_call is not None) else times,
            session_id=session_id,
        )
        self._rules.append(rule)
        return rule

    def clear_faults(self) -> None:
        self._rules.clear()

    def set_rule(self, rule: Rule | None) -> None:
        """Ask ``rule`` about every call from now on that no injected fault acts on (None: ask nothing).

        The rule sees the call's endpoint, session and the task the session was seeded for, after the per-call
        latency; the :class:`~nemo_gym_browser.testing.faults.Fault` it answers acts on that call.
        """
        self._rule = rule

    def _rule_for(self, endpoint: str, session_id: str) -> FaultRule | None:
        chosen = None
        for rule in self._rules:
            if rule.matches(endpoint, session_id):
                rule.seen += 1
                if chosen is None and rule.due:
                    chosen = rule
        if chosen is not None:
            chosen.fired += 1
        return chosen

    def set_latency(self, seconds: float, endpoint: str = "*") -> None:
        """A fixed delay before each call to ``endpoint`` (``"*"``: the server-wide default)."""
        name = _endpoint_name(endpoint)
        if name == "*":
            self.latency_s = seconds
        else:
            self._latency[name] = seconds

    def lose_session(self, session_id: str) -> None:
        """Forget a session without closing anything, as a restarted server has: tools then answer "no active
        session", verify reports the session not found. Its browser died with it, so nothing leaks."""
        if self._states.pop(session_id, None) is not None:
            logger.info("fake environment: session %s lost", session_id)
        self._typed_identity.pop(session_id, None)

    def crash_browser(self, session_id: str) -> None:
        """Kill the session's browser; the session stays (and still needs releasing)."""
        state = self._states.get(session_id)
        if state is not None:
            state.browser.crashed = True
            logger.info("fake environment: browser of session %s crashed", session_id)

    def _forget_everything(self) -> None:
        self._states.clear()
        self._typed_identity.clear()
        self._typed_closed.clear()
        self._typed_locks.clear()

    # ----- dispatch -------------------------------------------------------------------------------------------

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        cookie_session = self._cookies.decode(request.cookies.get(COOKIE_NAME))
        had_cookie_session = bool(cookie_session)
        # nemo_gym's add_session_id middleware: every request has a session id from here on.
        cookie_session.setdefault(_SESSION_ID_KEY, str(uuid.uuid4()))
        call = _Call(
            endpoint=request.path.lstrip("/"),
            raw=b"",
            content_type=request.headers.get("Content-Type"),
            cookie_session=cookie_session,
            had_cookie_session=had_cookie_session,
        )
        if call.endpoint not in _ENDPOINTS or request.method != "POST":
            response = self._not_an_endpoint(request)
            self._set_cookie(response, call)
            return response
        call.raw = await request.read()
        call.session_id = self._attribute(call)
        name = call.endpoint
        self._calls[name] += 1
        self._events.setdefault(call.session_id, []).append(_ENDPOINTS[name])

        delay = self._latency.get(name, self.latency_s)
        if delay > 0:
            await asyncio.sleep(delay)
        fault = self._fault_for(call)
        if fault is not None:
            logger.info("fake environment: %s on %s (session %s)", fault.kind, name, call.session_id)
            faulted = await self._apply(fault, call, request)
            if faulted is not None:
                return faulted

        try:
            response = await self._handlers[name](call)
        except _Unprocessable as exc:
            response = _json_response({"detail": exc.errors}, status=422)
        except Exception as exc:
            # nemo_gym's exception middleware: repr(exc) as a JSON string, outside the session middleware
            # (so no Set-Cookie).
            logger.debug("fake environment: %s answered 500: %r", name, exc)
            return _json_response(repr(exc), status=500)
        if fault is not None and fault.kind == "regrade" and response.status == 200 and response.body is not None:
            response.body = with_reward(response.body, fault.reward)
        self._set_cookie(response, call)
        return response

    def _fault_for(self, call: _Call) -> Fault | None:
        """The injected fault that is due for this call, else the rule's answer, else None."""
        injected = self._rule_for(call.endpoint, call.session_id)
        if injected is not None:
            return injected.fault
        if self._rule is None:
            return None
        seen = SeenRequest(call.endpoint, call.session_id, time.monotonic(), self._task_id(call))
        return self._rule(seen)

    async def _apply(self, fault: Fault, call: _Call, request: web.Request) -> web.StreamResponse | None:
        """Carry out ``fault`` before the handler: its answer, or None to let the call through to the handler."""
        if fault.kind == "status":
            return canned_answer(fault)
        if fault.kind == "drop":
            await drop_connection(request, fault)
        if fault.kind == "hang":
            await hold(fault)
        elif fault.kind == "lose_session":
            self.lose_session(call.session_id)
        elif fault.kind == "crash_browser":
            self.crash_browser(call.session_id)
        return None  # "regrade" acts on the handler's answer

    def _task_id(self, call: _Call) -> str | None:
        """The task the call's session was seeded for: the typed seed's own, or the one its session is bound to."""
        if isinstance(call.parsed, ResourcesSeedSessionRequest):
            return call.parsed.task_id.task_id
        identity = self._typed_identity.get(call.session_id)
        return identity[1].task_id if identity is not None else None

    @staticmethod
    def _not_an_endpoint(request: web.Request) -> web.Response:
        liveness = request.path in _LIVENESS_PATHS
        if liveness and request.method == "GET":
            return _json_response({"status": "ok"})
        if not liveness and request.path.lstrip("/") not in _ENDPOINTS:
            return _json_response({"detail": "Not Found"}, status=404)
        response = _json_response({"detail": "Method Not Allowed"}, status=405)
        response.headers["Allow"] = "GET" if liveness else "POST"
        return response

    def _attribute(self, call: _Call) -> str:
        """The session a call belongs to: a typed seed's or close's id, otherwise the cookie's."""
        if call.endpoint in ("seed_session", "close_session"):
            try:
                if call.endpoint == "seed_session":
                    call.parsed = _parse_body(call, _SEED_BODY, required=True)
                    if isinstance(call.parsed, ResourcesSeedSessionRequest):
                        return call.parsed.resources_session_id
                else:
                    call.parsed = _parse_body(call, _CLOSE_BODY, required=False)
                    typed = ResourcesCloseSessionRequest.model_validate(call.parsed) if call.parsed else None
                    if typed is not None:
                        return typed.resources_session_id
            except (_Unprocessable, ValidationError):
                call.parsed = None
        return call.cookie_session_id

    def _set_cookie(self, response: web.Response, call: _Call) -> None:
        # Starlette's SessionMiddleware: re-send a non-empty session; clear one that was emptied.
        if call.cookie_session:
            response.set_cookie(
                COOKIE_NAME,
                self._cookies.encode(call.cookie_session),
                path="/",
                max_age=_COOKIE_MAX_AGE_S,
                httponly=True,
                samesite="lax",
            )
        elif call.had_cookie_session:
            response.set_cookie(COOKIE_NAME, "null", path="/", expires=_COOKIE_EXPIRED, httponly=True, samesite="lax")

    # ----- lifecycle endpoints --------------------------------------------------------------------------------

    async def _seed_session(self, call: _Call) -> web.Response:
        body = call.parsed if call.parsed is not None else _parse_body(call, _SEED_BODY, required=True)
        if not isinstance(body, ResourcesSeedSessionRequest):
            await self._open_session(call.cookie_session_id, body)
            return _json_response({})

        session_id = body.resources_session_id
        call.cookie_session[_SESSION_ID_KEY] = session_id
        async with self._typed_locks.setdefault(session_id, asyncio.Lock()):
            if session_id in self._typed_closed:
                raise ValueError(f"resources session is already closed: {session_id}")
            identity = self._typed_identity.get(session_id)
            if identity is None:
                spec = BrowserSeedSessionRequest.model_validate(body.task_data)
                await self._open_session(session_id, spec)
                self._typed_identity[session_id] = (body.episode_id, body.task_id)
            elif identity != (body.episode_id, body.task_id):
                raise ValueError("resources_session_id is already bound to another episode or task")
        return _json_response({"resources_session_id": session_id, "resources_tools": None, "sandbox_access": None})

    async def _open_session(self, session_id: str, spec: BrowserSeedSessionRequest) -> None:
        initial_url = self.site.resolve_initial_url(spec.initial_url)
        self._release(session_id)  # a re-seeded id gives its old browser back first
        browser = _Browser(self.site)
        if self.browser_open_s > 0:
            try:
                await asyncio.sleep(self.browser_open_s)
            except asyncio.CancelledError:
                # The real open() unwinds on Exception only: a cancelled launch strands its browser.
                self.orphaned_browsers += 1
                logger.warning("fake environment: seed of %s cancelled while opening its browser", session_id)
                raise
        if initial_url:
            browser.goto(initial_url)  # raises Error: the seed answers 500 and nothing stays open
        self._states[session_id] = _SessionState(browser=browser, gt=dict(spec.verifier_metadata or {}))

    def _release(self, session_id: str | None) -> None:
        if session_id is not None:
            self._states.pop(session_id, None)

    async def _close_session(self, call: _Call) -> web.Response:
        body = _parse_body(call, _CLOSE_BODY, required=False)
        if not body:
            self._release(call.cookie_session.get(_SESSION_ID_KEY))
            return _json_response({"closed": True})
        try:
            typed = ResourcesCloseSessionRequest.model_validate(body)
        except ValidationError as exc:
            # Raised by hand in the real handler, so the errors keep pydantic's `url` and have no `body` prefix.
            raise _Unprocessable(_jsonable(exc.errors())) from exc
        session_id = typed.resources_session_id
        async with self._typed_locks.setdefault(session_id, asyncio.Lock()):
            closed_episode = self._typed_closed.get(session_id)
            if closed_episode is not None:
                if typed.episode_id != closed_episode:
                    raise ValueError("episode_id does not match the closed resources session")
            else:
                identity = self._typed_identity.get(session_id)
                if identity is not None and typed.episode_id != identity[0]:
                    raise ValueError("episode_id does not match the seeded resources session")
                self._release(session_id)
                self._typed_identity.pop(session_id, None)
                self._typed_closed[session_id] = typed.episode_id
        call.cookie_session.pop(_SESSION_ID_KEY, None)
        return _json_response({"resources_session_id": session_id})

    # ----- tools ----------------------------------------------------------------------------------------------

    def _tool_answer(self, call: _Call, verb: str, act: Callable[[_Browser], None]) -> web.Response:
        state = self._states.get(call.cookie_session_id)
        if state is None:
            return _json_response(ToolResponse(observation="", error=NO_SESSION_ERROR).model_dump())
        try:
            act(state.browser)
            observation = state.browser.observe(self.max_elements).render(self.max_elements)
        except Exception as exc:
            return _json_response(ToolResponse(observation="", error=f"{verb} failed: {exc}").model_dump())
        return _json_response(ToolResponse(observation=observation).model_dump())

    async def _browser_observe(self, call: _Call) -> web.Response:
        return self._tool_answer(call, "observe", lambda browser: None)  # takes no body: anything is accepted

    async def _browser_navigate(self, call: _Call) -> web.Response:
        body = _parse_body(call, _NAVIGATE_BODY, required=True)
        return self._tool_answer(call, "navigate", lambda browser: browser.goto(body.url))

    async def _browser_click(self, call: _Call) -> web.Response:
        body = _parse_body(call, _ELEMENT_BODY, required=True)
        return self._tool_answer(call, "click", lambda browser: browser.click(body.element_id))

    async def _browser_type(self, call: _Call) -> web.Response:
        body = _parse_body(call, _TYPE_BODY, required=True)
        return self._tool_answer(call, "type", lambda browser: browser.type(body.element_id, body.text))

    async def _browser_finish(self, call: _Call) -> web.Response:
        body = _parse_body(call, _FINISH_BODY, required=True)
        state = self._states.get(call.cookie_session_id)
        if state is None:
            return _json_response(ToolResponse(observation="", error=NO_SESSION_ERROR).model_dump())
        if not state.finished:  # the first finish wins
            state.answer = body.answer
            try:
                state.finished_url, state.finished_text = state.browser.finish_snapshot()
            except Exception:
                logger.warning("fake environment: no snapshot at finish for session %s", call.cookie_session_id)
        return _json_response(ToolResponse(observation="", done=True).model_dump())

    # ----- verify ---------------------------------------------------------------------------------------------

    async def _verify(self, call: _Call) -> web.Response:
        body = _parse_body(call, _VERIFY_BODY, required=True)
        session_id = call.cookie_session_id
        state = self._states.get(session_id)
        reward, failure_reason = 0.0, SESSION_NOT_FOUND_AT_VERIFY
        if state is not None:
            failure_reason = None
            try:
                reward = _score(state)
            except _ScoringUnavailable as exc:
                failure_reason = str(exc)
            finally:
                self._release(session_id)
        return _json_response(
            {
                "responses_create_params": body.responses_create_params.model_dump(mode="json"),
                "response": body.response.model_dump(mode="json"),
                "reward": reward,
                "mask_sample": False,
                "failure_kind": None,
                "failure_reason": failure_reason,
            }
        )


def _score(state: _SessionState) -> float:
    """Grade against the seed's verifier_metadata; the first supported key present decides."""
    gt = state.gt
    if "answer_equals" in gt:
        return float((state.answer or "").strip() == str(gt["answer_equals"]).strip())
    try:
        if state.finished:
            url, text = state.finished_url or "", state.finished_text or ""
        else:
            url, text = state.browser.finish_snapshot()
        if "final_url" in gt:
            return float(url == gt["final_url"])
        if "url_contains" in gt:
            return float(gt["url_contains"] in url)
        if "dom_contains" in gt:
            return float(str(gt["dom_contains"]).lower() in text.lower())
    except Exception as exc:
        raise _ScoringUnavailable(f"browser unreachable while scoring: {type(exc).__name__}: {exc}") from exc
    raise ValueError(
        f"verifier_metadata has no supported scoring key (got {sorted(gt)}; "
        f"expected one of {list(_SCORING_KEYS_IN_MESSAGE)})"
    )


# ----------------------------------------------------------------------------------------------------------------
# Running in a thread, for synchronous callers
# ----------------------------------------------------------------------------------------------------------------

_T = TypeVar("_T")


class ThreadedFakeEnvironment:
    """A :class:`FakeEnvironmentServer` on its own event loop in a daemon thread, for synchronous callers.

    ``with FakeEnvironmentServer().run_in_thread() as env: ...`` then talk to ``env.url``. ``inject`` and the
    inspection members of ``env.server`` are safe to use between requests; the port is closed and reopened with
    :meth:`stop_server`, :meth:`start_server` and :meth:`restart_server`.
    """

    _TIMEOUT_S = 10.0

    def __init__(self, server: FakeEnvironmentServer) -> None:
        self.server = server
        self._loop: BackgroundLoop | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def __enter__(self) -> ThreadedFakeEnvironment:
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(self) -> None:
        """Start the thread and the server in it. Idempotent."""
        if self._loop is not None:
            return
        self._loop = BackgroundLoop("fake-environment")
        self._loop.open()
        self.run(self.server.start())

    def run(self, coro: Coroutine[Any, Any, _T], *, timeout_s: float = _TIMEOUT_S) -> _T:
        """Run a coroutine on the server's loop and wait for its result."""
        if self._loop is None:
            coro.close()
            raise RuntimeError("the fake environment thread is not running")
        return self._loop.run(coro, timeout_s=timeout_s)

    def stop_server(self, *, lose_state: bool = False) -> None:
        self.run(self.server.stop(lose_state=lose_state))

    def start_server(self) -> None:
        self.run(self.server.start())

    def restart_server(self) -> None:
        self.run(self.server.restart())

    def close(self) -> None:
        """Stop the server and the thread. Idempotent."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            loop.run(self.server.stop(), timeout_s=self._TIMEOUT_S)
        finally:
            loop.close()
