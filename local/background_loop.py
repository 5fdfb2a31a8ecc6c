"""An asyncio event loop in a daemon thread, for synchronous callers that host an async server (a proxy, a fake).

``with BackgroundLoop("name") as loop: loop.run(coro)`` runs coroutines on the thread's loop and waits for their
results. ``close`` cancels whatever is still pending on the loop, stops it and joins the thread; it is idempotent.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")

# Joining the thread after the loop stopped: it has nothing left to do but return.
_JOIN_TIMEOUT_S = 5.0


class BackgroundLoop:
    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> BackgroundLoop:
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(self) -> None:
        """Start the thread and its loop. Idempotent."""
        if self._thread is not None:
            return
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=self.name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, _T], *, timeout_s: float) -> _T:
        """Run ``coro`` on the loop and wait at most ``timeout_s`` for its result."""
        if self._loop is None:
            coro.close()
            raise RuntimeError(f"{self.name}: the background loop is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout_s)

    def close(self) -> None:
        """Cancel what is pending, stop the loop and join the thread. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def cancel_pending() -> None:
            current = asyncio.current_task()
            pending = [task for task in asyncio.all_tasks() if task is not current]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_pending(), loop).result(timeout=_JOIN_TIMEOUT_S)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=_JOIN_TIMEOUT_S)
            loop.close()
            self._loop = self._thread = None
