"""A tiny static web site of our own, served on 127.0.0.1, for integration tests against the real browser server.

``local/site/`` holds three pages, each with text and elements a test can grade with every verifier key:

- ``index.html`` ("Test Site Home"): links to the About page and to preset results, a search form (input ``q`` and
  a "Search" button that loads ``results.html?q=...``), and a "Reveal code" button that shows
  "The secret code is 4417." on the same page.
- ``about.html`` ("About the Test Site"): "founded in 1999", a link home.
- ``results.html`` ("Search Results"): "Results for: <q>" from the query string, links to the other pages.

:class:`LocalSite` serves the folder from a daemon thread on a free loopback port. It is a context manager; ``stop``
shuts the server down and joins its thread. Nothing is written to disk and nothing is logged per request.
"""

from __future__ import annotations

import errno
import functools
import http.server
import logging
import threading
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

SITE_DIR = Path(__file__).resolve().parent / "site"
LOOPBACK = "127.0.0.1"
# Bounded join on stop: serve_forever polls its shutdown flag every 0.5 s.
STOP_TIMEOUT_S = 5.0


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        logger.debug("local site: " + format, *args)


class LocalSiteBusy(RuntimeError):
    """The port the site must be served on is taken."""


class LocalSite:
    """Serve ``SITE_DIR`` (or ``directory``) on ``http://127.0.0.1:<port>``.

    >>> with LocalSite() as site:  # doctest: +SKIP
    ...     site.page("about.html")  # 'http://127.0.0.1:41235/about.html'
    """

    def __init__(self, directory: Path | str = SITE_DIR, port: int = 0) -> None:
        self.directory = Path(directory)
        self._requested_port = port
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the local site is not started")
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        """Base URL without a trailing slash, e.g. ``http://127.0.0.1:41235``."""
        return f"http://{LOOPBACK}:{self.port}"

    def page(self, name: str) -> str:
        return f"{self.url}/{name.lstrip('/')}"

    def start(self) -> LocalSite:
        if self._server is not None:
            raise RuntimeError("the local site is already started")
        if not (self.directory / "index.html").is_file():
            raise FileNotFoundError(f"no index.html in {self.directory}")
        handler = functools.partial(_QuietHandler, directory=str(self.directory))
        try:
            self._server = http.server.ThreadingHTTPServer((LOOPBACK, self._requested_port), handler)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            # the shop's task URLs name their port: a second local run (or test run) on this machine cannot share it
            raise LocalSiteBusy(
                f"{LOOPBACK}:{self._requested_port} is taken (another local run or test run serving the site?): "
                f"stop it, or wait for it to end; {self.directory} is served only on this port"
            ) from None
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="local-site", daemon=True)
        self._thread.start()
        logger.info("local site serving %s at %s", self.directory, self.url)
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

    def __enter__(self) -> LocalSite:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
