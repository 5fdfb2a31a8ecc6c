"""The README's main command ends in the rehearsal: it must run here, against the real server, and its table must
agree with the estimator's contract (the rehearsal checks every advantage against a plain re-computation)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_the_rehearsal_rolls_out_real_episodes_and_prints_advantages_that_match_the_contract(real_environment):
    done = subprocess.run(
        [sys.executable, str(ROOT / "rehearsal.py"), "--url", real_environment.url],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = done.stdout
    assert "OK: episode walked and verified, reward 1.0" in out
    assert "OK: the table matches the estimator's contract" in out
    assert "sessions left open on the server: 0" in out
    # The lone valid survivor of a group is what stock GRPO rewards for nothing; the recipe gives it 0.
    home = [line.split() for line in out.splitlines() if line.split()[:2] == ["bundled--home", "0"]]
    assert len(home) == 1 and home[0][-2:] == ["+0.000", "+1.500"], out
