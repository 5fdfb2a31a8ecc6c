"""The MiniWoB++ task pages of the installed ``miniwob==1.1.0`` wheel, and the adapter each one is served with.

:func:`html_root` finds the wheel's pages without importing ``miniwob`` (its package imports gymnasium and selenium;
only ``html/`` is used) and refuses another version. :func:`adapted_page` is a task page unchanged but for one inline
script right after its ``core.js``, which on MiniWoB's own hooks (``core.startEpisode``, ``core.startEpisodeReal``,
``core.endEpisode``): seeds ``Math.random`` from the URL when the page loads and again just before the problem is
made (as MiniWoB's Python environment does); starts the episode without the START cover and hides the reward display;
disarms the time limit (``core.EPISODE_MAX_TIME``); keeps the first end (the finished problem stays, later clicks score
nothing, and a line says ``Episode over. MiniWoB reward: <raw>.``, plus ``Completion code: <code>`` on a raw reward of
1); and runs one episode per browser (a second task page in the same browser finds the ``localStorage`` mark and is
replaced by a notice). The code lives only in the script's closure; the script removes itself once it has run.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path

from .grading import CODE_LABEL

MINIWOB_VERSION = "1.1.0"
INSTALL_HINT = f"pip install 'verl-nemo-gym-browser[miniwob]' (or pip install miniwob=={MINIWOB_VERSION})"
TASK_FOLDER = "miniwob"
CORE_SCRIPT = '<script src="../core/core.js"></script>'
TASK_NAME = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
MAX_SEED = 2**31 - 1
EPISODE_NOTE_ID = "nemo-gym-browser-episode"
STORAGE_KEY = "nemo_gym_browser.miniwob"
ALREADY_RAN = "This browser has already run a MiniWoB episode; loading a task page again does not start another."

_ADAPTER = """<script>
(function () {
  "use strict";
  var TASK = __TASK__, SEED = __SEED__, CODE = __CODE__;
  var state = "loaded";  // -> "running" -> "ended"; or "refused" in a browser that already ran an episode
  var startReal = core.startEpisodeReal, endReal = core.endEpisode;
  if (document.currentScript) document.currentScript.remove();
  Math.seedrandom(SEED);

  function note(text) {
    var line = document.createElement("div");
    line.id = __NOTE_ID__;
    line.textContent = text;
    document.body.appendChild(line);
  }

  core.startEpisode = function () {
    if (state !== "loaded") return;  // core.endEpisode asks for the cover again: the finished problem stays
    core.createDisplay();
    core.hideDisplay();
    var ran;
    try {
      ran = window.localStorage.getItem(__STORAGE_KEY__);
      if (ran === null) window.localStorage.setItem(__STORAGE_KEY__, TASK + "/" + SEED);
    } catch (error) {
      ran = "no storage";  // without the mark a reload could replay the problem: do not start
    }
    if (ran !== null) {
      state = "refused";
      document.body.replaceChildren();  // nothing of the page stays to act on, only the notice
      note(__ALREADY_RAN__);
      return;
    }
    state = "running";
    core.cover_div = core.cover_div || document.createElement("div");
    Math.seedrandom(SEED);
    startReal();
    clearTimeout(core.EP_TIMER);
    core.EP_TIMER = 0;  // core.endEpisode scores only while this is not null; no timer stands behind it
    core.clearTimer();
  };

  core.endEpisode = function (reward, timeProportional, reason) {
    if (state !== "running") return;
    state = "ended";
    endReal(reward, false, reason);
    var raw = WOB_RAW_REWARD_GLOBAL;
    var text = "Episode over. MiniWoB reward: " + Number(raw).toFixed(2) + ".";
    if (raw >= 1) text += " " + __CODE_LABEL__ + ": " + CODE;
    note(text);
  };
})();
</script>"""


class MiniWobMissing(RuntimeError):
    """The ``miniwob`` wheel is not installed, or another version is."""


class PageError(ValueError):
    """A task name, seed or page the adapter refuses."""


def html_root() -> Path:
    """The wheel's ``html/`` folder (``miniwob/html/core/core.js``, ``miniwob/html/miniwob/<task>.html``, ...)."""
    spec = importlib.util.find_spec("miniwob")
    if spec is None or not spec.submodule_search_locations:
        raise MiniWobMissing(f"the MiniWoB++ pages are not installed: {INSTALL_HINT}")
    version = importlib.metadata.version("miniwob")
    if version != MINIWOB_VERSION:
        raise MiniWobMissing(f"miniwob {version} is installed; the suite is built on {MINIWOB_VERSION}: {INSTALL_HINT}")
    root = Path(next(iter(spec.submodule_search_locations))) / "html"
    if not (root / "core" / "core.js").is_file():
        raise MiniWobMissing(f"{root} has no core/core.js: reinstall with {INSTALL_HINT}")
    return root


def task_names(root: Path | None = None) -> list[str]:
    """Every task the wheel ships (the stems of ``html/miniwob/*.html``), sorted."""
    folder = (root or html_root()) / TASK_FOLDER
    return sorted(path.stem for path in folder.glob("*.html"))


def check_task(task: str) -> str:
    if not isinstance(task, str) or not TASK_NAME.match(task):
        raise PageError(f"{task!r} is not a MiniWoB task name")
    return task


def check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise PageError(f"a MiniWoB seed is an integer in [0, {MAX_SEED}], got {seed!r}")
    return seed


def adapter_script(task: str, seed: int, code: str) -> str:
    """The inline script that adapts one episode of ``task`` (see the module doc)."""
    values = {
        "__TASK__": json.dumps(check_task(task)),
        "__SEED__": str(check_seed(seed)),
        "__CODE__": json.dumps(code),
        "__NOTE_ID__": json.dumps(EPISODE_NOTE_ID),
        "__STORAGE_KEY__": json.dumps(STORAGE_KEY),
        "__ALREADY_RAN__": json.dumps(ALREADY_RAN),
        "__CODE_LABEL__": json.dumps(CODE_LABEL),
    }
    return re.sub("|".join(map(re.escape, values)), lambda match: values[match.group(0)], _ADAPTER)


def adapted_page(source: str, *, task: str, seed: int, code: str) -> str:
    """``source`` (a task page) with the adapter placed right after its one ``core.js`` script."""
    if source.count(CORE_SCRIPT) != 1:
        raise PageError(f"the {task} page does not load core.js exactly once; it cannot be adapted")
    return source.replace(CORE_SCRIPT, CORE_SCRIPT + "\n" + adapter_script(task, seed, code), 1)


def read_task_page(task: str, root: Path | None = None) -> str:
    path = (root or html_root()) / TASK_FOLDER / f"{check_task(task)}.html"
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PageError(f"MiniWoB {MINIWOB_VERSION} has no task {task!r}") from None
