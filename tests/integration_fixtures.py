"""Session-scoped fixtures for the integration tier: the real nemo-gym 0.7.0 server, and a local site to browse.

Registered as a pytest plugin from ``tests/conftest.py`` (``pytest_plugins = ["integration_fixtures"]``).

- ``real_environment``: a :class:`LocalEnvironment` (server + Chromium on 127.0.0.1) shared by the whole session and
  stopped at its end. It never skips: deselect the tier with ``-m "not integration"``. A missing or incomplete
  ``.venv-gym`` FAILS the requesting tests with the command that builds it.
  ``NEMO_GYM_BROWSER_TEST_BACKEND`` picks the backend (``remote_cdp`` by default, or ``local_playwright``);
  ``NEMO_GYM_BROWSER_GYM_VENV`` points at another gym virtual environment.
- ``local_site``: our static test site (``local/site``) on a loopback port.
- ``shop_site``, ``shop_rows``, ``tiny_policy``: the Corner Shop on its fixed loopback port, its task rows, and the
  warm-started tiny policy, for the tests that really train (built once per session).

A test that requests ``real_environment`` directly must carry ``@pytest.mark.integration``; collection stops with a
usage error otherwise, so the offline tier can never start a browser by accident.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_gym_browser.launch_environment import (
    DEFAULT_GYM_VENV,
    SETUP_HINT,
    Backend,
    EnvironmentStartError,
    LocalEnvironment,
    check_gym_venv,
)
from nemo_gym_browser.local.local_site import LocalSite

BACKEND_ENV_VAR = "NEMO_GYM_BROWSER_TEST_BACKEND"
GYM_VENV_ENV_VAR = "NEMO_GYM_BROWSER_GYM_VENV"
POLICY_DIR_ENV_VAR = "NEMO_GYM_BROWSER_TEST_POLICY_DIR"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [
        item.nodeid
        for item in items
        if "real_environment" in getattr(item, "fixturenames", ()) and item.get_closest_marker("integration") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "tests using the real_environment fixture must be marked @pytest.mark.integration: " + ", ".join(unmarked)
        )


@pytest.fixture(scope="session")
def real_environment() -> Iterator[LocalEnvironment]:
    gym_venv = Path(os.environ.get(GYM_VENV_ENV_VAR, str(DEFAULT_GYM_VENV)))
    backend = os.environ.get(BACKEND_ENV_VAR, Backend.REMOTE_CDP.value)
    problem = None
    try:
        check_gym_venv(gym_venv)
    except EnvironmentStartError as error:
        problem = (
            f"the integration tier needs the real environment, which is not set up: {error.diagnosis}\n"
            f"Build it once with: {SETUP_HINT}   (or run only the offline tier: pytest -m 'not integration')"
        )
    if problem is None:
        environment = LocalEnvironment(backend=backend, gym_venv=gym_venv)
        try:
            environment.start()
        except EnvironmentStartError as error:
            problem = f"the real interactive_browser environment did not come up: {error}"
    if problem is not None:
        pytest.fail(problem, pytrace=False)  # outside the except blocks: no chained traceback around the message
    try:
        yield environment
    finally:
        environment.stop()


@pytest.fixture(scope="session")
def local_site() -> Iterator[LocalSite]:
    with LocalSite() as site:
        yield site


@pytest.fixture(scope="session")
def shop_site() -> Iterator[LocalSite]:
    """The Corner Shop's pages on their fixed loopback port (the task files name it)."""
    from nemo_gym_browser.local import shop_tasks

    site = shop_tasks.serve()
    try:
        site.start()
    except OSError as error:  # the task files name this port: nothing else may hold it
        pytest.fail(f"cannot serve the shop on {shop_tasks.SHOP_ORIGIN}: {error}", pytrace=False)
    try:
        yield site
    finally:
        site.stop()


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The warm-started tiny policy for the shop tasks, built once per test session (about a minute on 2 cores).

    ``NEMO_GYM_BROWSER_TEST_POLICY_DIR`` keeps it across sessions: built there once, reused after.
    """
    from nemo_gym_browser.local.training_run import tiny_policy_folder

    kept = os.environ.get(POLICY_DIR_ENV_VAR)
    return tiny_policy_folder(Path(kept) if kept else tmp_path_factory.mktemp("policy"))


@pytest.fixture(scope="session")
def shop_rows(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Training rows (the shop's training tasks) and validation rows (its held-back tasks) for main_ppo."""
    from nemo_gym_browser.local import shop_tasks
    from nemo_gym_browser.local.training_run import prepare_task_rows

    return prepare_task_rows(tmp_path_factory.mktemp("rows"), shop_tasks.TRAIN_FILE, shop_tasks.HELD_BACK_FILE)
