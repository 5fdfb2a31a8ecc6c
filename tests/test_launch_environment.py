"""Offline checks of launch_environment.py and local/local_site.py: usage errors, diagnoses, and that a server
which fails or hangs during start-up leaves no process behind. The gym virtual environment here is a fake folder
whose ``bin/python`` is a small shell script; the real one is exercised by the integration tier.
"""

from __future__ import annotations

import os
import socket
import stat
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from nemo_gym_browser import launch_environment
from nemo_gym_browser.launch_environment import EnvironmentStartError, LocalEnvironment
from nemo_gym_browser.local.local_site import LocalSite


def fake_gym_venv(root: Path, python_script: str) -> Path:
    """A folder that passes check_gym_venv, whose python runs ``python_script`` (sh) in the server folder."""
    server_dir = root / "lib" / "python3.11" / "site-packages" / "resources_servers" / "interactive_browser"
    server_dir.mkdir(parents=True)
    (server_dir / "app.py").write_text("# stand-in\n")
    python = root / "bin" / "python"
    python.parent.mkdir()
    python.write_text("#!/bin/sh\n" + python_script)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    (root / launch_environment.SETUP_MARKER).write_text("fake")
    return root


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_the_cli_answers_usage_errors_with_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch_environment.main(["--port", "70000"])
    assert exit_info.value.code == 2
    assert "port out of range" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        launch_environment.main(["--backend", "firefox"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        launch_environment.main(["python", "smoke_environment.py"])  # a command must follow `--`
    assert exit_info.value.code == 2


def test_the_cli_names_the_setup_command_when_the_gym_venv_is_missing(tmp_path, capsys):
    assert launch_environment.main(["--gym-venv", str(tmp_path / "absent"), "--backend", "local_playwright"]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "bash scripts/setup_environment.sh" in err


def test_an_unfinished_setup_is_refused_with_the_setup_command(tmp_path):
    venv = fake_gym_venv(tmp_path / "venv", "exit 0\n")
    (venv / launch_environment.SETUP_MARKER).unlink()
    with pytest.raises(EnvironmentStartError, match=r"not a completed setup.*setup_environment\.sh"):
        LocalEnvironment(backend="local_playwright", gym_venv=venv).start()


def test_a_port_already_taken_is_diagnosed_before_anything_starts(tmp_path):
    venv = fake_gym_venv(tmp_path / "venv", "echo started > started.txt\n")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(EnvironmentStartError, match=f"port {port} is already in use"):
            LocalEnvironment(port=port, backend="local_playwright", gym_venv=venv).start()
    assert not list(venv.rglob("started.txt"))


def test_a_server_that_dies_at_import_is_diagnosed_from_its_log(tmp_path):
    venv = fake_gym_venv(tmp_path / "venv", "echo \"ModuleNotFoundError: No module named 'nemo_gym'\" >&2\nexit 1\n")
    env = LocalEnvironment(backend="local_playwright", gym_venv=venv, startup_timeout_s=30)
    with pytest.raises(EnvironmentStartError) as error:
        env.start()
    assert "incomplete; rebuild it: FORCE=1 bash scripts/setup_environment.sh" in error.value.diagnosis
    assert "No module named 'nemo_gym'" in error.value.log_tail
    assert env.workdir is None  # the private folder is gone with the processes


def test_a_server_that_never_answers_times_out_and_leaves_no_process(tmp_path):
    # The stand-in server and a child of it (as uvicorn's would be) record their pids, then hang.
    venv = fake_gym_venv(
        tmp_path / "venv", f"echo $$ > {tmp_path}/pids\nsleep 300 &\necho $! >> {tmp_path}/pids\nwait\n"
    )
    env = LocalEnvironment(backend="local_playwright", gym_venv=venv, startup_timeout_s=1.5)
    started = time.monotonic()
    with pytest.raises(EnvironmentStartError, match=r"did not answer .*/health within 1\.5 s"):
        env.start()
    assert time.monotonic() - started < 1.5 + launch_environment.STOP_GRACE_S + 5
    pids = [int(line) for line in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2
    assert not any(alive(pid) for pid in pids), [pid for pid in pids if alive(pid)]
    env.stop()  # idempotent


def test_the_local_site_serves_its_pages_on_loopback_and_stops(tmp_path):
    with LocalSite() as site:
        assert site.url.startswith("http://127.0.0.1:")
        for page, title in (
            ("index.html", "Test Site Home"),
            ("about.html", "About the Test Site"),
            ("results.html", "Search Results"),
        ):
            with urllib.request.urlopen(site.page(page), timeout=5) as response:
                assert response.status == 200
                assert f"<title>{title}</title>" in response.read().decode()
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(site.page("nope.html"), timeout=5)
        assert missing.value.code == 404
        url = site.url
    site.stop()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/index.html", timeout=2)


def test_the_local_site_refuses_a_folder_without_an_index(tmp_path):
    with pytest.raises(FileNotFoundError):
        LocalSite(directory=tmp_path).start()
    assert os.listdir(tmp_path) == []
