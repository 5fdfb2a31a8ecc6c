"""Walk one whole episode against a running NeMo Gym ``interactive_browser`` server, with no GPU and no policy.

It uses ``gym_contract/environment.py``, the client training uses, so a smoke that passes here means the training loop
can seed, act, finish, verify and close on that server: the cookie round-trips, the request bodies are accepted,
the verifier grades, and the browser is released afterwards.

Exit codes: 0 the episode walked and verified (with the expected reward, if one is expected); 1 the environment
misbehaved (the message says what to check); 2 usage or input error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_gym_browser.gym_contract.environment import EnvironmentClient, ToolResult, validate_verifier_metadata
from nemo_gym_browser.gym_contract.failures import EnvironmentFailure, FailureKind
from nemo_gym_browser.settings import EnvironmentConfig

# The server's own bundled example: a relative start URL resolves under the server's folder.
DEFAULT_INITIAL_URL = "site/index.html"
DEFAULT_VERIFIER = {"url_contains": "about.html"}
DEFAULT_LINK_TEXT = "About"
_ELEMENT_LINE = re.compile(r"^\s*\[(\d+)\]\s+([^:]+):\s*(.*)$")

EXAMPLES = """\
examples:
  # the server's bundled example episode (site/index.html -> About), expects reward 1.0
  python smoke_environment.py --url http://127.0.0.1:8100

  # your own start page and verifier; --click names the link or button to click before finishing
  python smoke_environment.py --url http://127.0.0.1:8100 \\
      --initial-url https://example.org/ --verifier '{"dom_contains": "Example Domain"}' --expect-reward 1.0

  # the first task of a prepared rollout file (start URL and verifier_metadata from the row)
  python smoke_environment.py --url http://127.0.0.1:8100 --task-file data/val.jsonl --task-index 0

exit codes: 0 walked and verified, 1 environment misbehaved, 2 usage or input error
"""


class UsageError(Exception):
    """Bad command-line input: exit 2."""


@dataclass(frozen=True)
class Episode:
    initial_url: str
    verifier_metadata: dict[str, Any] | None
    click_text: str | None
    answer: str
    expect_reward: float | None
    task_id: str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smoke_environment.py",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", required=True, help="base URL of the interactive_browser server")
    parser.add_argument("--initial-url", help=f"start URL to seed (default: {DEFAULT_INITIAL_URL})")
    parser.add_argument("--verifier", help='verifier_metadata as JSON, e.g. \'{"url_contains": "about"}\'')
    parser.add_argument(
        "--click",
        help=f"text of the element to click after the first observation "
        f"(default for the bundled episode: {DEFAULT_LINK_TEXT!r}; none otherwise)",
    )
    parser.add_argument("--answer", default="done", help="answer passed to browser_finish (default: done)")
    parser.add_argument(
        "--expect-reward",
        type=float,
        help="fail unless verify gives this reward (default: 1.0 for the bundled episode, any graded reward otherwise)",
    )
    parser.add_argument("--task-file", type=Path, help="a NeMo Gym rollout JSONL: take the episode from a row")
    parser.add_argument("--task-index", type=int, default=0, help="row index in --task-file (default 0)")
    parser.add_argument("--task-id", help="row whose id (or task_id) equals this, instead of --task-index")
    parser.add_argument("--timeout", type=float, default=60.0, help="per-call timeout in seconds (default 60)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the client's warnings and debug lines")
    parser.add_argument("--seed-timeout", type=float, default=120.0, help="seed timeout in seconds (default 120)")
    return parser


def _row_from_file(path: Path, index: int, task_id: str | None) -> tuple[dict[str, Any], int]:
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{path}:{line_no}: not JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise UsageError(f"{path}:{line_no}: a row must be a JSON object")
            rows.append((row, line_no))
    if task_id is not None:
        for row, line_no in rows:
            if task_id in (str(row.get("id")), str(row.get("task_id")), str(row.get("task", {}).get("id"))):
                return row, line_no
        raise UsageError(f"{path}: no row with id {task_id!r}")
    if not 0 <= index < len(rows):
        raise UsageError(f"{path}: --task-index {index} out of range ({len(rows)} rows)")
    return rows[index]


def episode_from_args(args: argparse.Namespace) -> Episode:
    if args.task_file is not None:
        if args.initial_url or args.verifier:
            raise UsageError("--task-file gives the start URL and verifier; do not combine it with those options")
        row, line_no = _row_from_file(args.task_file, args.task_index, args.task_id)
        initial_url = row.get("initial_url")
        if not isinstance(initial_url, str) or not initial_url:
            raise UsageError(f"{args.task_file}:{line_no}: the row has no initial_url")
        try:
            verifier = validate_verifier_metadata(row.get("verifier_metadata"))
        except ValueError as exc:
            raise UsageError(f"{args.task_file}:{line_no}: {exc}") from exc
        task_id = str(row.get("id") or row.get("task_id") or f"line{line_no}")
        return Episode(initial_url, verifier, args.click, args.answer, args.expect_reward, task_id)
    bundled = args.initial_url is None and args.verifier is None
    verifier: dict[str, Any] | None = dict(DEFAULT_VERIFIER) if bundled else None
    if args.verifier is not None:
        try:
            verifier = validate_verifier_metadata(json.loads(args.verifier))
        except json.JSONDecodeError as exc:
            raise UsageError(f"--verifier is not JSON: {exc.msg}") from exc
        except ValueError as exc:
            raise UsageError(f"--verifier: {exc}") from exc
    return Episode(
        initial_url=args.initial_url or DEFAULT_INITIAL_URL,
        verifier_metadata=verifier,
        click_text=args.click if args.click is not None else (DEFAULT_LINK_TEXT if bundled else None),
        answer=args.answer,
        expect_reward=args.expect_reward if args.expect_reward is not None else (1.0 if bundled else None),
        task_id="smoke" if bundled else "smoke-custom",
    )


def find_element(observation: str, text: str) -> int | None:
    """The id of the first listed element whose name contains ``text`` (case-insensitive)."""
    for line in observation.splitlines():
        match = _ELEMENT_LINE.match(line)
        if match and text.lower() in match.group(3).lower():
            return int(match.group(1))
    return None


def _brief_observation(observation: str) -> str:
    lines = observation.splitlines()
    url = next((line[5:] for line in lines if line.startswith("URL: ")), "?")
    title = next((line[7:] for line in lines if line.startswith("TITLE: ")), "?")
    elements = sum(1 for line in lines if _ELEMENT_LINE.match(line))
    return f"url={url} title={title!r} elements={elements}"


DIAGNOSES = {
    FailureKind.UNREACHABLE: "the server is not reachable: is it running, on this host and port, and is the URL right?",
    FailureKind.SEED_FAILED: "the server could not open the start page or rejected the seed request: check the "
    "server log, the start URL, and that the server is nemo-gym 0.7.0 (typed seed)",
    FailureKind.SESSION_LOST: "the server does not know the session after seeding: the session cookie is not "
    "round-tripping (a proxy stripping cookies?) or the server lost its browser (check its log)",
    FailureKind.SERVER_ERROR: "the server answered 5xx or a malformed body: check the server log",
    FailureKind.TIMEOUT: "a call hung past its timeout: the browser behind the server is stuck or overloaded",
    FailureKind.VERIFY_UNAVAILABLE: "verify could not grade: the browser died before scoring, or the request "
    "schema was rejected (check the server version and log)",
}


async def walk(url: str, episode: Episode, call_timeout: float, seed_timeout: float) -> int:
    config = EnvironmentConfig(
        server_urls=(url,),
        call_timeout_s=call_timeout,
        seed_timeout_s=seed_timeout,
        verify_timeout_s=call_timeout,
        close_timeout_s=min(call_timeout, 15.0),
        transient_retries=0,  # a smoke reports the first failure as it is
    )
    step = 0

    def report(name: str, started: float, detail: str) -> None:
        nonlocal step
        step += 1
        print(f"  {step}. {name:<9} {1000 * (time.perf_counter() - started):7.0f} ms  {detail}")

    async def timed(name: str, action: Callable[[], Awaitable[ToolResult]]) -> ToolResult:
        started = time.perf_counter()
        result = await action()
        detail = f"error: {result.error}" if result.error else _brief_observation(result.observation)
        report(name, started, detail if result.observation or result.error else f"done={result.done}")
        return result

    print(f"smoke: {url}  start={episode.initial_url}  verifier={json.dumps(episode.verifier_metadata)}")
    rollout_id = f"smoke-{uuid.uuid4().hex[:8]}"
    reward: float | None = None
    session = None
    try:
        async with EnvironmentClient(config) as client:
            started = time.perf_counter()
            async with client.session(
                rollout_id=rollout_id,
                attempt=0,
                task_id=episode.task_id,
                initial_url=episode.initial_url,
                verifier_metadata=episode.verifier_metadata,
            ) as session:
                report("seed", started, f"session {session.session_id}")
                first = await timed("observe", session.observe)
                if first.error:
                    print(f"FAIL: the first observation failed: {first.error}")
                    return 1
                if episode.click_text:
                    element = find_element(first.observation, episode.click_text)
                    if element is None:
                        print(f"FAIL: no element named {episode.click_text!r} on the start page")
                        return 1
                    clicked = await timed("click", lambda: session.click(element))
                    if clicked.error:
                        print(f"FAIL: clicking {episode.click_text!r} failed: {clicked.error}")
                        return 1
                await timed("finish", lambda: session.finish(episode.answer))
                if episode.verifier_metadata:
                    started = time.perf_counter()
                    result = await session.verify()
                    reward = result.reward
                    report("verify", started, f"reward={reward}")
                else:
                    print("  (no verifier_metadata: this task is graded by the judge; verify skipped)")
                started = time.perf_counter()
            report("close", started, "released")
            released = await session.is_released()
            print(f"  {step + 1}. released  server no longer holds the session: {released}")
    except EnvironmentFailure as failure:
        print(f"FAIL ({failure.kind.value}): {failure.reason}")
        print(f"diagnosis: {DIAGNOSES.get(failure.kind, 'see the server log')}")
        return 1
    if not released:
        print("FAIL: the session was left open on the server after close (a leaked browser)")
        return 1
    if episode.expect_reward is not None and reward != episode.expect_reward:
        print(f"FAIL: verify graded reward {reward}, expected {episode.expect_reward}")
        print("diagnosis: the episode did not reach the verifier's target; check the start URL and verifier")
        return 1
    print(f"OK: episode walked{'' if reward is None else f' and verified, reward {reward}'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.ERROR, format="%(levelname)s %(message)s")
    if not re.match(r"^https?://[^/]+", args.url):
        parser.error(f"--url must be an http(s) base URL, got {args.url!r}")
    if args.timeout <= 0 or args.seed_timeout <= 0:
        parser.error("timeouts must be positive")
    try:
        episode = episode_from_args(args)
    except UsageError as exc:
        print(f"smoke_environment.py: error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(walk(args.url.rstrip("/"), episode, args.timeout, args.seed_timeout))


if __name__ == "__main__":
    raise SystemExit(main())
