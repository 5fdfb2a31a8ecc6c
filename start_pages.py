"""Open a sample of the data's own start pages through an environment server, from the node this runs on.

A task's start page is a live site (WebVoyager's all are). On a node that cannot reach the sites every seed fails
(``seed_failed``), every rollout is kept out of the loss, and the run learns nothing without an error. This check
seeds one session per sampled page as the agent loop seeds an episode (``gym_contract/environment.py``: the typed seed,
the same client), observes it, closes it, and reports how many pages loaded, which did not with the server's own
message, and which proxy variables the environment server and its Chromium get (``gym_contract/credentials.py``; a
proxy's user and password are never printed).

The sample: one start URL per distinct host (host and port), the hosts most rows start on first, ties in the order
the files list them: the same data gives the same sample. Rows that start on the server's own pages (a relative
``initial_url``) or on no page need no web and are not sampled.

Exit codes: 0 at least ``--min-share`` of the sampled pages loaded (or no row starts on a web page); 1 fewer did;
2 usage or input error (an unreadable or malformed data file).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nemo_gym_browser.gym_contract.credentials import proxy_settings, redact_url_credentials
from nemo_gym_browser.gym_contract.environment import EnvironmentClient
from nemo_gym_browser.gym_contract.failures import EnvironmentFailure, FailureKind
from nemo_gym_browser.gym_contract.rows import RowValueError, parse_row_json
from nemo_gym_browser.gym_contract.text import shorten
from nemo_gym_browser.gym_contract.url_safety import DEFAULT_PORTS, UrlRefused, parse_web_url, url_scheme
from nemo_gym_browser.settings import EnvironmentConfig
from nemo_gym_browser.task_lists.tasks import InputError, Task, task_from_nemo_gym_row

DEFAULT_SAMPLE = 8
DEFAULT_MIN_SHARE = 0.5
# The recipe's own seed timeout (EnvironmentConfig.seed_timeout_s): a page slower than that fails in training too.
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_CONCURRENCY = 8
# A failure as printed: the server's message up to its call log, enough to act on, one line.
MESSAGE_CHARS = 240
_NET_ERROR = re.compile(r"net::(ERR_[A-Z_]+)")
_SESSION_PREFIX = re.compile(r"^session \S+: ")

# What a Chromium network error says about the node, for the errors a node without the web gives.
_NO_DNS = "the node cannot resolve the site's name: no DNS to the web here, or a proxy is needed"
CAUSES = {
    "ERR_NAME_NOT_RESOLVED": _NO_DNS,
    "ERR_NAME_RESOLUTION_FAILED": _NO_DNS,
    "ERR_INTERNET_DISCONNECTED": "the node has no network route to the web",
    "ERR_ADDRESS_UNREACHABLE": "no route from the node to the site",
    "ERR_NETWORK_UNREACHABLE": "no route from the node to the site",
    "ERR_CONNECTION_TIMED_OUT": "no answer from the site (a firewall, or a proxy not set)",
    "ERR_TIMED_OUT": "no answer from the site (a firewall, or a proxy not set)",
    "ERR_CONNECTION_REFUSED": "nothing accepts connections at the site's address from this node",
    "ERR_CONNECTION_RESET": "the connection was cut (a firewall or a gateway in the way?)",
    "ERR_PROXY_CONNECTION_FAILED": "the proxy set for Chromium does not answer",
    "ERR_TUNNEL_CONNECTION_FAILED": "the proxy refused to connect to the site",
    "ERR_PROXY_AUTH_UNSUPPORTED": "the proxy asks for an authentication Chromium does not offer",
    "ERR_CERT_AUTHORITY_INVALID": "a certificate the browser does not trust (a TLS-inspecting gateway?)",
}

EXAMPLES = """\
examples:
  # the training and validation rows' start pages, 8 hosts, through a server on this node
  python start_pages.py --url http://127.0.0.1:8100 --data data/train.jsonl data/val.jsonl

  # every host of the data (up to 50), and fail unless 90 % load
  python start_pages.py --url http://127.0.0.1:8100 --data data/train.jsonl --sample 50 --min-share 0.9

exit codes: 0 enough start pages loaded (or none to check), 1 too few loaded, 2 usage or input error
"""


@dataclass(frozen=True)
class StartPage:
    """One sampled page: the first row's start URL on its host, and how many rows start on that host."""

    url: str
    host: str
    task_id: str
    rows: int


@dataclass(frozen=True)
class Sample:
    pages: tuple[StartPage, ...]
    hosts: int  # distinct hosts the data starts on
    web_rows: int  # rows whose start page is on the web
    other_rows: int  # rows that start on the server's own pages or on none


@dataclass(frozen=True)
class Outcome:
    page: StartPage
    loaded: bool
    seconds: float
    detail: str  # the page's title when it loaded, the server's message when not
    cause: str | None = None


def read_tasks(path: Path) -> list[Task]:
    """Every row of one JSONL file as a task, each by the rules the dataset applies (``rows.parse_row_json``,
    ``tasks.task_from_nemo_gym_row``), without importing torch as ``dataset.py`` does: the check runs on every node
    before any GPU work. The first bad line raises :class:`InputError` naming it."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise InputError(str(path), f"cannot read: {exc.strerror}") from exc
    tasks = []
    for lineno, raw in enumerate(lines, 1):
        location = f"{path}:{lineno}"
        try:
            text = raw.decode("utf-8").removeprefix("\ufeff")
            if not text.strip():
                continue
            row = parse_row_json(text)
        except (UnicodeDecodeError, RowValueError) as exc:
            raise InputError(location, str(exc)) from None
        if not isinstance(row, dict) or "responses_create_params" not in row:
            raise InputError(location, "not a NeMo Gym row (no 'responses_create_params')")
        tasks.append(task_from_nemo_gym_row(row, location))
    return tasks


def sample_start_pages(tasks: Iterable[Task], count: int) -> Sample:
    """One start URL per host, for the ``count`` hosts most rows start on (ties: the first seen first)."""
    first: dict[str, Task] = {}
    rows: dict[str, int] = {}
    web_rows = other_rows = 0
    for task in tasks:
        url = task.initial_url
        if not url or url_scheme(url) is None:
            other_rows += 1
            continue
        try:
            parsed = parse_web_url(url)
        except UrlRefused:  # the row contract admits only web URLs with a host; none other is the web's to check
            other_rows += 1
            continue
        host = parsed.host if parsed.port == DEFAULT_PORTS[parsed.scheme] else f"{parsed.host}:{parsed.port}"
        web_rows += 1
        first.setdefault(host, task)
        rows[host] = rows.get(host, 0) + 1
    order = sorted(first, key=lambda host: -rows[host])  # sorted() is stable: ties keep their first-seen order
    pages = tuple(
        StartPage(url=str(first[host].initial_url), host=host, task_id=first[host].task_id, rows=rows[host])
        for host in order[:count]
    )
    return Sample(pages=pages, hosts=len(first), web_rows=web_rows, other_rows=other_rows)


def failure_message(failure: EnvironmentFailure) -> str:
    """The failure as one bounded line: the server's message without the session id and the call log."""
    text = _SESSION_PREFIX.sub("", failure.reason)
    text = re.split(r"(?:\\+n|\n)\s*Call log", text, maxsplit=1)[0]  # a newline, or one escaped once or twice
    return shorten(redact_url_credentials(text), MESSAGE_CHARS, one_line=True)


def failure_cause(failure: EnvironmentFailure, timeout_s: float) -> str | None:
    if failure.kind is FailureKind.UNREACHABLE:
        return "the environment server did not answer (see the smoke episode)"
    if "did not answer within" in failure.reason:
        return f"the page did not load within {timeout_s:g} s: no route to the site, or a proxy not set?"
    error = _NET_ERROR.search(failure.reason)
    return CAUSES.get(error.group(1)) if error else None


async def open_page(client: EnvironmentClient, page: StartPage, run: str, index: int, timeout_s: float) -> Outcome:
    """Seed a session on ``page`` as the agent loop seeds an episode, observe it, and close it (always)."""
    started = time.perf_counter()
    try:
        async with client.session(
            rollout_id=f"start-page-{run}-{index}", attempt=0, task_id=page.task_id, initial_url=page.url
        ) as session:
            observed = await session.observe()
    except EnvironmentFailure as failure:
        seconds = time.perf_counter() - started
        return Outcome(page, False, seconds, failure_message(failure), failure_cause(failure, timeout_s))
    seconds = time.perf_counter() - started
    if observed.error:  # the page loaded, and the browser could not read it
        return Outcome(page, False, seconds, shorten(f"observe failed: {observed.error}", MESSAGE_CHARS, one_line=True))
    title = next((line[7:] for line in observed.observation.splitlines() if line.startswith("TITLE: ")), "")
    return Outcome(page, True, seconds, shorten(title, 80, one_line=True))


async def open_pages(url: str, sample: Sample, timeout_s: float, concurrency: int) -> list[Outcome]:
    config = EnvironmentConfig(
        server_urls=(url,),
        seed_timeout_s=timeout_s,
        call_timeout_s=timeout_s,
        verify_timeout_s=timeout_s,
        placement="process",
        max_sessions_per_server=concurrency,
    )
    run = uuid.uuid4().hex[:8]
    async with EnvironmentClient(config) as client:
        return list(
            await asyncio.gather(
                *(open_page(client, page, run, index, timeout_s) for index, page in enumerate(sample.pages))
            )
        )


def describe_proxies(environ: Mapping[str, str]) -> str:
    settings = proxy_settings(environ)
    if not settings:
        return "none (no HTTP_PROXY, HTTPS_PROXY or ALL_PROXY in either case: Chromium connects to the sites directly)"
    return ", ".join(f"{name}={value}" for name, value in settings.items())


def likely_cause(outcomes: Sequence[Outcome], proxies: dict[str, str]) -> str:
    """One sentence on why the pages did not load, from the failures' causes and whether a proxy is set."""
    failed = [outcome for outcome in outcomes if not outcome.loaded]
    if failed and all(outcome.cause and "environment server" in outcome.cause for outcome in failed):
        return "the environment server itself did not answer: check it before the sites"
    if any(name.upper() != "NO_PROXY" for name in proxies):
        return (
            "a proxy is set for Chromium: check that this node reaches it and that it lets these sites through "
            "(NO_PROXY must not name them)"
        )
    return (
        "this node may have no route to the task sites, or the web is reached through a proxy that is not set "
        "(export HTTPS_PROXY and HTTP_PROXY, and NO_PROXY, in the job's environment: they reach Chromium)"
    )


def report(
    node: str, url: str, sample: Sample, outcomes: Sequence[Outcome], min_share: float, environ: Mapping[str, str]
) -> bool:
    """Print the report; True when enough pages loaded."""
    print(
        f"start pages: {len(sample.pages)} of the {sample.hosts} host(s) that {sample.web_rows} row(s) start on "
        f"({sample.other_rows} start on the server's own pages or none), through {url}"
    )
    print(f"proxy for the environment server and its Chromium on {node}: {describe_proxies(environ)}")
    width = max((len(redact_url_credentials(o.page.url)) for o in outcomes), default=0)
    for outcome in outcomes:
        shown = redact_url_credentials(outcome.page.url).ljust(width)
        timing = f"{1000 * outcome.seconds:7.0f} ms"
        if outcome.loaded:
            print(f"  ok    {shown}  {timing}  {outcome.detail!r}  ({outcome.page.rows} row(s) start here)")
        else:
            because = f" -> {outcome.cause}" if outcome.cause else ""
            print(f"  FAIL  {shown}  {timing}  {outcome.detail}{because}")
    loaded = sum(outcome.loaded for outcome in outcomes)
    share = loaded / len(outcomes)
    enough = share >= min_share
    print(
        f"{loaded} of {len(outcomes)} start pages loaded on {node} "
        f"({share:.0%}; at least {min_share:.0%} required){'' if enough else ': too few'}"
    )
    if not enough:
        print(f"likely cause: {likely_cause(outcomes, proxy_settings(environ))}")
    return enough


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from error
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a share between 0 and 1, not {value:g}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from error
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="start_pages.py",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", required=True, help="base URL of the interactive_browser server to seed through")
    parser.add_argument("--data", type=Path, nargs="+", required=True, help="NeMo Gym rollout JSONL file(s)")
    parser.add_argument(
        "--sample", type=_positive_int, default=DEFAULT_SAMPLE, help=f"hosts to check (default {DEFAULT_SAMPLE})"
    )
    parser.add_argument(
        "--min-share",
        type=_share,
        default=DEFAULT_MIN_SHARE,
        help=f"fail when a smaller share of the sampled pages loads (default {DEFAULT_MIN_SHARE:g})",
    )
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help=f"seconds per page (default {DEFAULT_TIMEOUT_S:g})"
    )
    parser.add_argument(
        "--concurrency",
        type=_positive_int,
        default=DEFAULT_CONCURRENCY,
        help=f"pages open at once (default {DEFAULT_CONCURRENCY})",
    )
    parser.add_argument("--node", help="the node's name in the report (default: this host's name)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the client's warnings and debug lines")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.ERROR, format="%(levelname)s %(message)s")
    if not re.match(r"^https?://[^/]+", args.url):
        parser.error(f"--url must be an http(s) base URL, got {args.url!r}")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    try:
        tasks = [task for path in args.data for task in read_tasks(path)]
    except InputError as exc:
        print(f"start_pages.py: error: {exc}", file=sys.stderr)
        return 2
    node = args.node or socket.gethostname().split(".")[0]
    sample = sample_start_pages(tasks, args.sample)
    if not sample.pages:
        print(f"start pages: none of the {len(tasks)} row(s) starts on a web page: nothing to check on {node}")
        return 0
    url = args.url.rstrip("/")
    outcomes = asyncio.run(open_pages(url, sample, args.timeout, args.concurrency))
    return 0 if report(node, url, sample, outcomes, args.min_share, dict(os.environ)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
