"""The lifetime of a test HTTP server on 127.0.0.1 that can go down and come back on the same port.

:class:`LoopbackServer` is what the in-process environment server and the fault proxy share: ``start`` listens (port 0
picks a free port, kept across stops), ``stop`` closes the port and cuts every open connection, requests in flight
included, and clients on the same event loop see the cut before their next request; both are idempotent.
``async with`` starts the server and closes it on the way out. A subclass says what it serves
(:meth:`LoopbackServer._application`) and what else ``close`` releases.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Self

from aiohttp import web

logger = logging.getLogger(__name__)

# A stopped server should not wait on handlers it is cutting off anyway.
_SHUTDOWN_TIMEOUT_S = 0.05
# Clients on this event loop see the closed connections before they reuse a pooled one, as a client of a real
# (remote) server would by the time it sends its next request.
_PEERS_NOTICE_CLOSE_S = 0.01


class LoopbackServer:
    """An aiohttp server on ``127.0.0.1:<port>`` with an explicit, restartable lifetime (see the module doc)."""

    # How the server names itself in errors and logs.
    description = "the loopback server"

    def __init__(self, *, port: int = 0) -> None:
        self.port = port
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def url(self) -> str:
        if not self.port:
            raise RuntimeError(f"{self.description} has not been started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._runner is not None

    def _application(self) -> web.Application:
        """The app to serve, built anew at each start."""
        raise NotImplementedError

    def _runner_options(self) -> dict[str, Any]:
        """Extra ``web.AppRunner`` options (keep-alive, say)."""
        return {}

    async def start(self) -> None:
        """Listen on 127.0.0.1 (the same port as before after a stop). Idempotent."""
        if self._runner is not None:
            return
        runner = web.AppRunner(
            self._application(),
            access_log=None,
            handler_cancellation=True,  # a client that goes away cancels its handler (nemo_gym's disconnect middleware)
            shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
            **self._runner_options(),
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self.port = runner.addresses[0][1]
        self._runner = runner
        logger.debug("%s listening on %s", self.description, self.url)

    async def stop(self) -> None:
        """Close the port and cut every open connection, requests in flight included. Idempotent."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
            await asyncio.sleep(_PEERS_NOTICE_CLOSE_S)

    async def close(self) -> None:
        """Stop, and release whatever else the server holds. Idempotent."""
        await self.stop()
