"""The MiniWoB++ site: the wheel's task pages, adapted per episode, on ``http://127.0.0.1:<port>``.

What it serves (GET and HEAD only)
    * ``/miniwob/<task>.html?seed=<n>``: the task page with the adapter of :mod:`.pages`, for that seed and the
      completion code :class:`~.grading.GradeKey` gives it; never cached.
    * ``/core/...`` and ``/common/...``: the scripts, styles and images the pages load, byte for byte from the
      installed wheel (``.js``, ``.css``, ``.png``, ``.gif`` only; no page of these folders, nothing outside them).
    * Anything else, a second query parameter, a seed that is not a number: a short fixed error page. No answer
      echoes the request (a URL the policy writes never becomes page text), and a request that names another host
      than ``127.0.0.1:<port>`` (``localhost``, say: another origin, with storage of its own) is refused.

:class:`MiniWobSite` serves from a daemon thread; it is a context manager, and ``stop`` shuts the server down and
joins its thread. Nothing is written to disk; requests are logged at debug level only.
"""

from __future__ import annotations

import errno
import http.server
import logging
import sys
import threading
from pathlib import Path
from types import TracebackType
from urllib.parse import parse_qsl, unquote, urlsplit

from .grading import GradeKey
from .pages import TASK_FOLDER, PageError, adapted_page, check_seed, html_root, read_task_page

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Fixed like the Corner Shop's 8765: the rows name it, so prompts and observations are the same from run to run.
MINIWOB_PORT = 8766
STOP_TIMEOUT_S = 5.0
STATIC_FOLDERS = ("core", "common")
CONTENT_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
    ".gif": "image/gif",
}
_NOT_FOUND = "Not found."
_BAD_QUERY = "A MiniWoB task page takes one query parameter: seed, a whole number."
_WRONG_HOST = "This site answers only on its own address."


class MiniWobSiteBusy(RuntimeError):
    """The port the site must be served on is taken."""


def task_url(task: str, seed: int, *, port: int = MINIWOB_PORT) -> str:
    """Where an episode of ``task`` with ``seed`` starts."""
    return f"http://{LOOPBACK}:{port}/{TASK_FOLDER}/{task}.html?seed={check_seed(seed)}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("miniwob site: " + format, *args)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, *, body: bool) -> None:
        status, content_type, payload = self._route()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def _route(self) -> tuple[int, str, bytes]:
        site = self.server.site
        if self.headers.get("Host") != f"{LOOPBACK}:{site.port}":
            return _text(421, _WRONG_HOST)
        parts = urlsplit(self.path)
        segments = unquote(parts.path).split("/")
        if len(segments) == 3 and segments[0] == "" and segments[1] == TASK_FOLDER and segments[2].endswith(".html"):
            return self._task_page(segments[2].removesuffix(".html"), parts.query)
        if len(segments) >= 3 and segments[0] == "" and segments[1] in STATIC_FOLDERS and not parts.query:
            return self._static(segments[1:])
        return _text(404, _NOT_FOUND)

    def _task_page(self, task: str, query: str) -> tuple[int, str, bytes]:
        site = self.server.site
        pairs = parse_qsl(query, keep_blank_values=True)
        if len(pairs) != 1 or pairs[0][0] != "seed" or not pairs[0][1].isdigit() or len(pairs[0][1]) > 10:
            return _text(400, _BAD_QUERY)
        try:
            seed = check_seed(int(pairs[0][1]))
            source = read_task_page(task, site.root)
            page = adapted_page(source, task=task, seed=seed, code=site.key.completion_code(task, seed))
        except PageError:
            return _text(404, _NOT_FOUND)
        return 200, "text/html; charset=utf-8", page.encode("utf-8")

    def _static(self, segments: list[str]) -> tuple[int, str, bytes]:
        root = self.server.site.root
        if any(part in ("", ".", "..") or "\\" in part for part in segments):
            return _text(404, _NOT_FOUND)
        path = root.joinpath(*segments)
        content_type = CONTENT_TYPES.get(path.suffix)
        if content_type is None or not path.resolve().is_relative_to(root.resolve()) or not path.is_file():
            return _text(404, _NOT_FOUND)
        return 200, content_type, path.read_bytes()


def _text(status: int, message: str) -> tuple[int, str, bytes]:
    page = f"<!doctype html><title>MiniWoB</title><p>{message}</p>"
    return status, "text/html; charset=utf-8", page.encode("utf-8")


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    site: MiniWobSite

    def handle_error(self, request: object, client_address: tuple[str, int]) -> None:
        """A browser that went away mid-answer (a session closed or lost) is no error of the site's."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            logger.debug("%s went away before its answer was written", client_address)
            return
        super().handle_error(request, client_address)


class MiniWobSite:
    """The adapted MiniWoB++ pages on ``http://127.0.0.1:<port>`` (:data:`MINIWOB_PORT` unless told).

    >>> with MiniWobSite(GradeKey.generate()) as site:  # doctest: +SKIP
    ...     site.task_url("click-button", 7)  # 'http://127.0.0.1:8766/miniwob/click-button.html?seed=7'
    """

    def __init__(self, key: GradeKey, *, port: int = MINIWOB_PORT, root: Path | None = None) -> None:
        self.key = key
        self.root = root or html_root()
        self._requested_port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the MiniWoB site is not started")
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def task_url(self, task: str, seed: int) -> str:
        return task_url(task, seed, port=self.port)

    def start(self) -> MiniWobSite:
        if self._server is not None:
            raise RuntimeError("the MiniWoB site is already started")
        try:
            server = _Server((LOOPBACK, self._requested_port), _Handler)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise MiniWobSiteBusy(
                f"{LOOPBACK}:{self._requested_port} is taken (another run serving MiniWoB?): the rows name this port"
            ) from None
        server.site = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="miniwob-site", daemon=True)
        self._thread.start()
        logger.info("MiniWoB site serving %s at %s", self.root, self.url)
        return self

    def stop(self) -> None:
        """Stop serving; idempotent."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=STOP_TIMEOUT_S)

    def __enter__(self) -> MiniWobSite:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
