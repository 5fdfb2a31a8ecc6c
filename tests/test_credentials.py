"""Which variables count as credentials, what a browser-side process keeps, and how text loses them."""

from __future__ import annotations

from nemo_gym_browser.gym_contract.credentials import (
    BROWSER_SIDE_VARIABLES,
    REDACTED,
    browser_side_environment,
    redact,
    secret_values,
)

ENVIRON = {
    "HF_TOKEN": "hf_0123456789",
    "WANDB_API_KEY": "wandb-0123456789",
    "RAY_AUTH_TOKEN": "ray-0123456789",
    "MY_JUDGE": "judge-0123456789",  # a key under a name that does not say so: named by the judge's config
    "DB_PASSWORD": "pw-0123456789",
    "SHORT_TOKEN": "1",  # too short to redact without garbling every line
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONPATH": "/recipe",
}


def test_secrets_are_found_by_name_and_by_the_judges_key_variable():
    assert secret_values(ENVIRON, ["MY_JUDGE", None]) == {
        "hf_0123456789",
        "wandb-0123456789",
        "ray-0123456789",
        "judge-0123456789",
        "pw-0123456789",
    }


def test_a_browser_side_process_keeps_only_the_allow_list_and_the_launchers_settings():
    kept = browser_side_environment(ENVIRON, TMPDIR="/tmp/x")

    assert kept == {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": "/tmp/x"}
    assert all(reason for reason in BROWSER_SIDE_VARIABLES.values())  # every kept variable says why


def test_redaction_takes_a_secret_out_whole_even_when_another_contains_it():
    text = redact("a=abc123456789 b=abc12345678 c", {"abc12345678", "abc123456789"})

    assert text == f"a={REDACTED} b={REDACTED} c"
