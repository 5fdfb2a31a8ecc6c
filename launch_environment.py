"""Bring up the real NeMo Gym 0.7.0 ``interactive_browser`` resources server on 127.0.0.1, and take it down again.

:class:`LocalEnvironment` runs the server from ``.venv-gym`` (``scripts/setup_environment.sh``) as NeMo Gym starts
each server, with Debian's headless Chromium behind it: backend ``remote_cdp`` (default; one Chromium of ours over
CDP on a loopback port) or ``local_playwright`` (the server launches one per session from a
``PLAYWRIGHT_BROWSERS_PATH`` folder of links to ``--chromium``).

Guarantees: everything binds 127.0.0.1; the server and Chromium get an allow-listed environment
(:mod:`~nemo_gym_browser.gym_contract.credentials`); every wait is bounded, and a server that does not come up raises
:class:`EnvironmentStartError` with a diagnosis and the tail of its log. ``stop()`` (also on ``with`` exit, Ctrl-C,
SIGTERM in the CLI and interpreter exit) ends by PID everything this object started and nothing else; if this
process is SIGKILLed, a parent-death signal takes the server and Chromium too. Details:
``docs/rehearsal-and-cpu-training.md#real-local-environment``.

CLI::

    python launch_environment.py --port 8100                 # until Ctrl-C
    python launch_environment.py -- python smoke_environment.py --url {url}   # run one command against it
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import concurrent.futures
import contextlib
import enum
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from nemo_gym_browser.gym_contract.credentials import browser_side_environment
from nemo_gym_browser.processes import (
    Proc,
    all_processes,
    cmdline,
    descendants,
    die_with_parent,
    executable_name,
    is_alive,
    stop_process_group,
)

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent
DEFAULT_GYM_VENV = REPO_ROOT / ".venv-gym"
DEFAULT_CHROMIUM = Path("/usr/bin/chromium")
SETUP_HINT = "bash scripts/setup_environment.sh"
LOOPBACK = "127.0.0.1"
URL_ENV_VAR = "NEMO_GYM_BROWSER_URL"
# NeMo Gym's server instance name; the session cookie is named after it.
SERVER_INSTANCE = "interactive_browser"
SERVER_SUBDIR = Path("resources_servers") / "interactive_browser"
SETUP_MARKER = ".setup-complete"
PLAYWRIGHT_BROWSERS_SUBDIR = "playwright-browsers"
# Debian's /usr/bin/chromium is a launcher script; Playwright must exec the binary it runs.
DEBIAN_CHROMIUM_LAUNCHER = Path("/usr/bin/chromium")
DEBIAN_CHROMIUM_BINARY = Path("/usr/lib/chromium/chromium")

# The server imports ~2.7 s of modules on an idle core; 2 shared cores under a parallel test run can be 10x slower.
DEFAULT_STARTUP_TIMEOUT_S = 120.0
CHROMIUM_STARTUP_TIMEOUT_S = 30.0
# SIGTERM first so uvicorn and Chromium shut down cleanly; SIGKILL whatever is left after this grace period.
STOP_GRACE_S = 10.0
HTTP_PROBE_TIMEOUT_S = 2.0
POLL_INTERVAL_S = 0.2
# The probe episode covers the browser path (Playwright driver, CDP connect, first navigation) on a cold machine.
PROBE_TIMEOUT_S = 60.0
LOG_TAIL_LINES = 40
# Executable names of a Chromium build (Debian's, and the names Playwright's folder layout links to it under).
CHROMIUM_NAMES = frozenset({"chromium", "chrome", "chrome-headless-shell", "headless_shell"})
# What stop() may find outside its process groups: Chromium's daemonized crash handlers and Playwright's pieces.
SWEPT_NAMES = CHROMIUM_NAMES | {"chrome_crashpad_handler", "node"}

# Flags for the CDP Chromium. `about:blank` matters: Playwright's connect_over_cdp waits forever for a start page
# that never committed a navigation, which is what Chromium opens when given no URL. Crashpad must stay enabled:
# with --disable-crashpad-for-testing Debian's Chromium 156 crashes its network service on every navigation.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    # Chromium asks a time server of its vendor on its own (seen through a proxy in the tests): no traffic of its own.
    "--disable-features=NetworkTimeServiceQuerying",
)


class Backend(enum.StrEnum):
    REMOTE_CDP = "remote_cdp"
    LOCAL_PLAYWRIGHT = "local_playwright"


class EnvironmentStartError(RuntimeError):
    """The local environment did not come up; ``diagnosis`` says what to do, ``log_tail`` what the server said."""

    def __init__(self, diagnosis: str, log_tail: str = "") -> None:
        super().__init__(diagnosis if not log_tail else f"{diagnosis}\n--- last log lines ---\n{log_tail}")
        self.diagnosis = diagnosis
        self.log_tail = log_tail


@dataclass(frozen=True)
class BrowserState:
    """What the server holds open right now. ``None`` means "not measurable with this backend"."""

    contexts: int | None  # browser contexts on the CDP Chromium besides its default one (remote_cdp)
    pages: int | None  # page targets inside those contexts (remote_cdp)
    drivers: int  # Playwright driver processes under the server: one per open session, both backends
    browsers: int  # Chromium browser processes the server launched (local_playwright)

    @property
    def idle(self) -> bool:
        return not (self.contexts or self.pages or self.drivers or self.browsers)


# --------------------------------------------------------------------------------------------- small HTTP helpers
# urlopen would send loopback requests to a proxy the environment names (urllib has no implicit loopback bypass).
_LOOPBACK_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http_json(
    url: str, *, body: object | None = None, cookie: str | None = None, timeout: float
) -> tuple[int, object, str | None]:
    """One request to a loopback URL: returns (status, parsed JSON or text, Set-Cookie header or None)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    request.add_header("content-type", "application/json")
    if cookie:
        request.add_header("cookie", cookie)
    try:
        with _LOOPBACK_OPENER.open(request, timeout=timeout) as response:
            status, raw, set_cookie = response.status, response.read(), response.headers.get("set-cookie")
    except urllib.error.HTTPError as error:
        status, raw, set_cookie = error.code, error.read(), None
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = raw.decode(errors="replace")
    return status, payload, set_cookie


def _answers(url: str) -> bool:
    try:
        status, _, _ = _http_json(url, timeout=HTTP_PROBE_TIMEOUT_S)
    except (OSError, ValueError):
        return False
    return status == 200


def free_port() -> int:
    """A loopback port free right now (the OS picks it; a small race remains until the server binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(HTTP_PROBE_TIMEOUT_S)
        return sock.connect_ex((LOOPBACK, port)) == 0


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    # Debian's Chromium logs a dbus complaint per second in a container; it says nothing about our failure.
    kept = [line for line in text.splitlines() if "dbus" not in line]
    return "\n".join(kept[-lines:])


def _diagnose(log_tail: str, port: int) -> str:
    if "address already in use" in log_tail.lower() or "errno 98" in log_tail.lower():
        return f"port {port} is already in use on {LOOPBACK}: pick another --port or stop what holds it"
    if "ModuleNotFoundError" in log_tail or "ImportError" in log_tail:
        return f"the gym virtual environment is incomplete; rebuild it: FORCE=1 {SETUP_HINT}"
    if "AlmostServerError" in log_tail or "validation error" in log_tail.lower():
        return "NeMo Gym rejected the generated server config (see the log below)"
    return "the interactive_browser server exited during start-up (see the log below)"


# --------------------------------------------------------------------------------------------- CDP introspection
async def _cdp_contexts_and_pages(ws_url: str, timeout_s: float) -> tuple[int, int]:
    import aiohttp  # the trainer's venv has it; importing this module stays cheap without it

    client_timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=client_timeout) as session, session.ws_connect(ws_url) as ws:

        async def call(call_id: int, method: str) -> dict:
            await ws.send_json({"id": call_id, "method": method})
            while True:
                message = await ws.receive_json()
                if message.get("id") == call_id:
                    return message["result"]

        # Target.getBrowserContexts lists only contexts created over CDP, never the default one.
        contexts = set((await call(1, "Target.getBrowserContexts"))["browserContextIds"])
        targets = (await call(2, "Target.getTargets"))["targetInfos"]
    pages = sum(1 for t in targets if t.get("type") == "page" and t.get("browserContextId") in contexts)
    return len(contexts), pages


# --------------------------------------------------------------------------------------------- the environment
_LIVE: weakref.WeakSet[LocalEnvironment] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for env in list(_LIVE):
        env.stop()


def find_server_dir(gym_venv: Path) -> Path:
    matches = sorted(gym_venv.glob(f"lib/python3*/site-packages/{SERVER_SUBDIR}/app.py"))
    if not matches:
        raise EnvironmentStartError(
            f"no {SERVER_SUBDIR}/app.py in {gym_venv}: the gym virtual environment is missing or incomplete; "
            f"run: {SETUP_HINT}"
        )
    return matches[-1].parent


def check_gym_venv(gym_venv: Path) -> None:
    """Raise EnvironmentStartError, telling how to fix it, unless ``gym_venv`` is a completed setup."""
    python = gym_venv / "bin" / "python"
    if python.is_symlink() and not python.exists():
        # A venv links to the interpreter it was built from: on a shared file system, that host's path.
        raise EnvironmentStartError(
            f"{python} links to {os.path.realpath(python)}, which is missing on {socket.gethostname()}: install that "
            f"interpreter at that path here, or build the venv on this host: FORCE=1 GYM_VENV={gym_venv} {SETUP_HINT}"
        )
    if not python.exists():
        raise EnvironmentStartError(f"{gym_venv} does not exist (or has no bin/python); run: {SETUP_HINT}")
    if not (gym_venv / SETUP_MARKER).exists():
        raise EnvironmentStartError(f"{gym_venv} is not a completed setup (no {SETUP_MARKER}); run: {SETUP_HINT}")
    find_server_dir(gym_venv)


def playwright_executable(chromium: Path) -> Path:
    """What Playwright should run for ``chromium``: the file it names, or for Debian's launcher script its binary."""
    resolved = Path(os.path.realpath(chromium))
    if resolved == DEBIAN_CHROMIUM_LAUNCHER and DEBIAN_CHROMIUM_BINARY.exists():
        return DEBIAN_CHROMIUM_BINARY
    return resolved


def playwright_browsers(template: Path, executable: Path, folder: Path) -> Path:
    """``folder`` laid out as ``template`` (the gym venv's browser folder, named after its Playwright's browser
    revisions by the setup script), with each of its links pointing at ``executable``: a PLAYWRIGHT_BROWSERS_PATH."""
    for path in sorted(template.rglob("*")):
        target = folder / path.relative_to(template)
        if path.is_symlink():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(executable)
        elif path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            shutil.copyfile(path, target)  # Playwright's INSTALLATION_COMPLETE markers
    return folder


class LocalEnvironment:
    """A real ``interactive_browser`` server (and, for ``remote_cdp``, its Chromium) on 127.0.0.1.

    >>> with LocalEnvironment() as env:  # doctest: +SKIP
    ...     print(env.url)
    """

    def __init__(
        self,
        port: int | None = None,
        backend: Backend | str = Backend.REMOTE_CDP,
        *,
        gym_venv: Path | str | None = None,
        chromium: Path | str = DEFAULT_CHROMIUM,
        max_elements: int = 50,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        probe: bool = True,
    ) -> None:
        self.backend = Backend(backend)
        self.port = port
        self.gym_venv = Path(gym_venv) if gym_venv is not None else DEFAULT_GYM_VENV
        self.chromium = Path(chromium)
        self.max_elements = max_elements
        self.startup_timeout_s = startup_timeout_s
        self.probe = probe
        self.cdp_port: int | None = None
        self.workdir: Path | None = None
        self.browsers_path: Path | None = None  # local_playwright: the PLAYWRIGHT_BROWSERS_PATH the server gets
        self.startup_s: float | None = None
        self._server: subprocess.Popen[bytes] | None = None
        self._chromium: subprocess.Popen[bytes] | None = None
        self._stop_lock = threading.Lock()

    # ----- properties
    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the environment is not started")
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def cdp_url(self) -> str | None:
        return None if self.cdp_port is None else f"http://{LOOPBACK}:{self.cdp_port}"

    @property
    def server_log(self) -> Path | None:
        return None if self.workdir is None else self.workdir / "server.log"

    @property
    def chromium_log(self) -> Path | None:
        return None if self.workdir is None else self.workdir / "chromium.log"

    @property
    def pids(self) -> set[int]:
        """The server's and (remote_cdp) Chromium's process ids: the roots of the environment's process tree."""
        return {process.pid for process in (self._server, self._chromium) if process is not None}

    @property
    def running(self) -> bool:
        return self._server is not None and self._server.poll() is None

    # ----- lifetime
    def __enter__(self) -> LocalEnvironment:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> LocalEnvironment:
        if self._server is not None:
            raise RuntimeError("the environment is already started")
        started = time.monotonic()
        check_gym_venv(self.gym_venv)
        server_dir = find_server_dir(self.gym_venv)
        if self.port is None:
            self.port = free_port()
        elif _port_in_use(self.port):
            raise EnvironmentStartError(f"port {self.port} is already in use on {LOOPBACK}; pick another --port")
        self.workdir = Path(tempfile.mkdtemp(prefix="nemo-gym-browser-env-"))
        _LIVE.add(self)
        try:
            backend_config = self._start_browser_side()
            self._start_server(server_dir, backend_config)
            self._wait_for_server(started)
            if self.probe:
                self._probe_episode()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        logger.info("interactive_browser (%s) ready at %s in %.1f s", self.backend.value, self.url, self.startup_s)
        return self

    def _child_env(self) -> dict[str, str]:
        """The allow-listed environment of the server and Chromium: they render untrusted pages, so none of our
        credentials (judge key, HF_TOKEN, WANDB_API_KEY, RAY_AUTH_TOKEN, ...) and no Python settings of ours."""
        assert self.workdir is not None
        # Everything a child writes lands in our folder and names it on its command line, so stop() can find
        # stragglers by it: Chromium's crash handlers (they daemonize) and Playwright's browser profiles.
        folders = {}
        for var, sub in (("TMPDIR", "tmp"), ("XDG_CONFIG_HOME", "xdg-config")):
            (self.workdir / sub).mkdir(exist_ok=True)
            folders[var] = str(self.workdir / sub)
        return browser_side_environment(os.environ, **folders, PYTHONUNBUFFERED="1")

    def _require_chromium(self) -> None:
        if not os.access(self.chromium, os.X_OK):
            raise EnvironmentStartError(
                f"{self.chromium} not found on {socket.gethostname()}; run: {SETUP_HINT}, or pass --chromium PATH"
            )

    def _start_browser_side(self) -> dict:
        assert self.workdir is not None
        if self.backend is Backend.LOCAL_PLAYWRIGHT:
            template = self.gym_venv / PLAYWRIGHT_BROWSERS_SUBDIR
            if template.is_dir():
                self._require_chromium()
                folder = self.workdir / PLAYWRIGHT_BROWSERS_SUBDIR
                self.browsers_path = playwright_browsers(template, playwright_executable(self.chromium), folder)
            return {"local_playwright": {"headless": True}}
        self._require_chromium()
        self.cdp_port = free_port()
        profile = self.workdir / "chromium-profile"
        command = [
            str(self.chromium),
            *CHROMIUM_FLAGS,
            f"--remote-debugging-address={LOOPBACK}",
            f"--remote-debugging-port={self.cdp_port}",
            f"--user-data-dir={profile}",
            "about:blank",
        ]
        assert self.chromium_log is not None
        with self.chromium_log.open("wb") as log:
            self._chromium = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self._child_env(), start_new_session=True, preexec_fn=die_with_parent(),
            )  # fmt: skip
        logger.debug("started Chromium pid %s, CDP on %s", self._chromium.pid, self.cdp_url)
        deadline = time.monotonic() + CHROMIUM_STARTUP_TIMEOUT_S
        while not _answers(f"{self.cdp_url}/json/version"):
            if self._chromium.poll() is not None:
                raise EnvironmentStartError(
                    f"Chromium exited with code {self._chromium.returncode} during start-up",
                    _tail(self.chromium_log),
                )
            if time.monotonic() > deadline:
                raise EnvironmentStartError(
                    f"Chromium did not open its CDP endpoint {self.cdp_url} within {CHROMIUM_STARTUP_TIMEOUT_S:.0f} s",
                    _tail(self.chromium_log),
                )
            time.sleep(POLL_INTERVAL_S)
        return {"remote_cdp": {"session_provider": {"static_cdp": {"cdp_url": self.cdp_url}}}}

    def _start_server(self, server_dir: Path, backend_config: dict) -> None:
        assert self.workdir is not None and self.server_log is not None
        config = {
            SERVER_INSTANCE: {
                "resources_servers": {
                    SERVER_INSTANCE: {
                        "entrypoint": "app.py",
                        "domain": "agent",  # required by NeMo Gym's config validation
                        "host": LOOPBACK,
                        "port": self.port,
                        "num_workers": 1,  # browsers live in the server process
                        "backend": backend_config,
                        "max_elements": self.max_elements,
                    }
                }
            }
        }
        config_path = self.workdir / "interactive_browser.yaml"
        config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        env = self._child_env()
        env["NEMO_GYM_CONFIG_PATH"] = SERVER_INSTANCE
        env["PLAYWRIGHT_BROWSERS_PATH"] = str(self.browsers_path or self.gym_venv / PLAYWRIGHT_BROWSERS_SUBDIR)
        command = [
            str(self.gym_venv / "bin" / "python"),
            "app.py",
            f"+config_paths=[{config_path}]",
            f"hydra.run.dir={self.workdir / 'hydra'}",  # not the default ./outputs inside the venv
        ]
        with self.server_log.open("wb") as log:
            self._server = subprocess.Popen(
                command, cwd=server_dir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, start_new_session=True, preexec_fn=die_with_parent(),
            )  # fmt: skip
        logger.debug("started interactive_browser pid %s on %s (log %s)", self._server.pid, self.url, self.server_log)

    def _wait_for_server(self, started: float) -> None:
        assert self._server is not None and self.server_log is not None and self.port is not None
        deadline = started + self.startup_timeout_s
        while True:
            if self._server.poll() is not None:
                tail = _tail(self.server_log)
                raise EnvironmentStartError(f"{_diagnose(tail, self.port)} (exit code {self._server.returncode})", tail)
            if _answers(f"{self.url}/health"):
                return
            if time.monotonic() > deadline:
                raise EnvironmentStartError(
                    f"the interactive_browser server did not answer {self.url}/health within "
                    f"{self.startup_timeout_s:g} s (machine overloaded? raise --startup-timeout)",
                    _tail(self.server_log),
                )
            time.sleep(POLL_INTERVAL_S)

    def _probe_episode(self) -> None:
        """Seed, observe and close one session, so "ready" also means the browser path works."""
        session_id = f"launch-probe-{os.getpid()}-{time.monotonic_ns()}"
        episode = {"rollout_id": session_id, "attempt": 0}
        seed = {
            "resources_session_id": session_id,
            "episode_id": episode,
            "task_id": {"taskset": "launch_probe", "task_id": "probe"},
            "task_data": {"initial_url": "about:blank", "verifier_metadata": {"url_contains": "about:blank"}},
        }
        try:
            status, payload, set_cookie = _http_json(f"{self.url}/seed_session", body=seed, timeout=PROBE_TIMEOUT_S)
            if status != 200 or not set_cookie:
                raise EnvironmentStartError(
                    f"the server is up but could not open a browser (seed answered {status}: {str(payload)[:300]})",
                    _tail(self.server_log) if self.server_log else "",
                )
            cookie = set_cookie.split(";", 1)[0]
            status, payload, _ = _http_json(f"{self.url}/browser_observe", body={}, cookie=cookie, timeout=30)
            if status != 200 or not isinstance(payload, dict) or payload.get("error"):
                raise EnvironmentStartError(f"the probe session could not observe its page: {status} {payload}")
        except OSError as error:
            raise EnvironmentStartError(f"the probe episode failed: {type(error).__name__}: {error}") from error
        finally:
            with contextlib.suppress(OSError):
                body = {"resources_session_id": session_id, "episode_id": episode}
                _http_json(f"{self.url}/close_session", body=body, timeout=PROBE_TIMEOUT_S)

    def stop(self) -> None:
        """Stop everything this environment started. Idempotent; never raises."""
        with self._stop_lock:
            try:
                self._stop_locked()
            except Exception:  # a failed stop must not hide the error that led here
                logger.exception("stopping the local environment failed")

    def _stop_locked(self) -> None:
        leaders = [p for p in (self._server, self._chromium) if p is not None]
        if not leaders and self.workdir is None:
            return
        # Snapshot first: once leaders die, their children are reparented and no longer findable by parentage.
        owned = self._owned_processes()
        for popen, name in ((self._server, "interactive_browser server"), (self._chromium, "Chromium")):
            if popen is not None:
                stop_process_group(popen, name, STOP_GRACE_S)
        survivors = [p for p in owned + self._owned_processes() if is_alive(p)]
        for proc in survivors:
            logger.warning("killing leftover process %s (%s)", proc.pid, cmdline(proc.pid)[:120])
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signal.SIGKILL)
        self._server = self._chromium = None
        self.browsers_path = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        _LIVE.discard(self)

    def _owned_processes(self) -> list[Proc]:
        procs = all_processes()
        roots = {p.pid for p in (self._server, self._chromium) if p is not None}
        owned = {p.pid: p for p in descendants(roots, procs)}
        if self.workdir is not None:
            marker = str(self.workdir)
            me = os.getpid()
            for proc in procs:
                # Only browser-side programs: a shell that merely tails our log is not ours to kill.
                if proc.pid == me or proc.pid in roots or executable_name(proc.pid) not in SWEPT_NAMES:
                    continue
                if marker in cmdline(proc.pid):
                    owned[proc.pid] = proc
        return list(owned.values())

    # ----- leak checks
    def browser_state(self, timeout_s: float = 10.0) -> BrowserState:
        """What the server holds open now. Safe to call from inside a running event loop (it uses a thread)."""
        if not self.running:
            raise RuntimeError("the environment is not running")
        assert self._server is not None
        server_tree = descendants({self._server.pid}, all_processes())
        commands = [cmdline(p.pid) for p in server_tree]
        drivers = sum(1 for c in commands if "playwright" in c and "run-driver" in c)
        # A browser's main process runs the Chromium binary without a --type= (renderer, gpu, zygote, ...) switch.
        browsers = sum(
            1
            for p, c in zip(server_tree, commands, strict=True)
            if executable_name(p.pid) in CHROMIUM_NAMES and "--type=" not in c
        )
        contexts = pages = None
        if self.cdp_url is not None:
            _, version, _ = _http_json(f"{self.cdp_url}/json/version", timeout=timeout_s)
            ws_url = version["webSocketDebuggerUrl"]  # type: ignore[index]
            # Its own loop in its own thread: callable from sync code and from inside a running event loop alike.
            with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
                future = pool.submit(asyncio.run, _cdp_contexts_and_pages(ws_url, timeout_s))
                contexts, pages = future.result(timeout=timeout_s + 1)
        return BrowserState(contexts=contexts, pages=pages, drivers=drivers, browsers=browsers)

    def wait_for_idle(self, timeout_s: float = 15.0) -> BrowserState:
        """Poll :meth:`browser_state` until nothing is open or ``timeout_s`` passes; return the last state.

        A close answers before the Playwright driver process has fully exited, hence the wait.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.browser_state()
            if state.idle or time.monotonic() > deadline:
                return state
            time.sleep(POLL_INTERVAL_S)


# --------------------------------------------------------------------------------------------- CLI
EPILOG = """examples:
  python launch_environment.py --port 8100
      a real interactive_browser on http://127.0.0.1:8100 (Chromium over CDP); Ctrl-C stops everything
  python launch_environment.py --port 8100 --backend local_playwright
      the server launches one Chromium per session itself
  python smoke_environment.py --url http://127.0.0.1:8100
      (in another shell) walk one episode against it
  python launch_environment.py -- python smoke_environment.py --url {url}
      start, walk one episode against it, stop everything; exit with the smoke test's exit code

exit codes: 0 stopped cleanly after Ctrl-C/SIGTERM, 1 the environment did not come up (with a diagnosis),
2 usage error; with a command after `--`, that command's exit code.
Set the environment up first with: bash scripts/setup_environment.sh
"""


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from error
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range 1-65535: {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launch_environment.py",
        description="Start NeMo Gym 0.7.0's interactive_browser resources server and headless Chromium on "
        "127.0.0.1, print its URL, and run until interrupted.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--port", type=_port, default=None, help="server port (default: a free one)")
    parser.add_argument(
        "--backend",
        choices=[b.value for b in Backend],
        default=Backend.REMOTE_CDP.value,
        help="browser backend (default: %(default)s)",
    )
    parser.add_argument(
        "--gym-venv",
        type=Path,
        default=DEFAULT_GYM_VENV,
        help="nemo-gym virtual environment (default: .venv-gym in the repository)",
    )
    parser.add_argument(
        "--chromium",
        type=Path,
        default=DEFAULT_CHROMIUM,
        help="the Chromium the server drives, over CDP (remote_cdp) or through Playwright (local_playwright) "
        "(default: %(default)s)",
    )
    parser.add_argument("--max-elements", type=int, default=50, help="elements per observation")
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=DEFAULT_STARTUP_TIMEOUT_S,
        help="seconds to wait for readiness (default: %(default)g)",
    )
    parser.add_argument("--no-probe", action="store_true", help="skip the probe episode that checks the browser")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="after `--`: a command to run once the environment is ready ({url} is replaced by its URL, which is also "
        f"in ${URL_ENV_VAR}); everything is stopped when it ends and its exit code is ours",
    )
    return parser


def _run_command(command: list[str], url: str) -> int:
    argv = [part.replace("{url}", url) for part in command]
    print(f"running: {' '.join(argv)}", flush=True)
    try:
        returncode = subprocess.run(argv, env={**os.environ, URL_ENV_VAR: url}, check=False).returncode
    except OSError as error:
        print(f"error: could not run {argv[0]}: {error}", file=sys.stderr)
        return 2
    return returncode if returncode >= 0 else 1  # killed by a signal


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.command and args.command[0] != "--":
        parser.error(f"unrecognized arguments: {' '.join(args.command)} (put a command to run after `--`)")
    if args.max_elements < 1 or args.startup_timeout <= 0:
        parser.error("--max-elements and --startup-timeout must be positive")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    # SIGINT too: a shell that starts us in the background hands us SIGINT ignored.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_keyboard_interrupt)
    env = LocalEnvironment(
        port=args.port,
        backend=args.backend,
        gym_venv=args.gym_venv.resolve(),
        chromium=args.chromium,
        max_elements=args.max_elements,
        startup_timeout_s=args.startup_timeout,
        probe=not args.no_probe,
    )
    try:
        env.start()
    except EnvironmentStartError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted during start-up; stopped", file=sys.stderr)
        return 0
    try:
        print(f"interactive_browser ({env.backend.value}) ready in {env.startup_s:.1f} s", flush=True)
        print(env.url, flush=True)
        if env.cdp_url:
            print(f"Chromium CDP: {env.cdp_url}", flush=True)
        print(f"server log: {env.server_log}  (Ctrl-C stops everything)", flush=True)
        if command:
            return _run_command(command, env.url)
        while env.running:
            time.sleep(0.5)
        print(f"error: the server exited unexpectedly:\n{_tail(env.server_log)}", file=sys.stderr)  # type: ignore[arg-type]
        return 1
    except KeyboardInterrupt:
        print("stopping", flush=True)
        return 0
    finally:
        env.stop()


if __name__ == "__main__":
    raise SystemExit(main())
