"""Credentials stay where they are needed: what a browser-side process may inherit, and what logs must not show.

What this module owns
    * The environment of the processes that render untrusted pages, the NeMo Gym server and its Chromium
      (:func:`browser_side_environment`): an allow-list, :data:`BROWSER_SIDE_VARIABLES`, never a copy of ours. A
      page the policy opened runs in that Chromium, and a server exploit would read the server's environment, so
      the judge key, ``HF_TOKEN``, ``WANDB_API_KEY``, ``RAY_AUTH_TOKEN`` and anything else of the trainer's stay out.
    * Which values are secrets (:func:`secret_values`): variables whose name says so (``*_TOKEN``, ``*_KEY``,
      ``*SECRET*``, ``*PASSWORD*``, ...) and any the caller names (the judge's ``api_key_env``).
    * Taking them out of text a server sent before it is logged or stored (:func:`redact`): an endpoint may echo a
      request header, or any value it learnt, into an error body.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

REDACTED = "***"
# Shorter values are not redacted: replacing "1" or "true" everywhere would garble every log line, and a secret that
# short is no secret.
MIN_SECRET_CHARS = 8
SECRET_NAME = re.compile(r"(TOKEN|_KEY$|^KEY$|API_?KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)

# What the environment server and its Chromium keep of the launcher's environment, and why.
BROWSER_SIDE_VARIABLES: dict[str, str] = {
    "PATH": "finding executables (Chromium, Playwright's node driver)",
    "HOME": "libraries that expect a home folder (Playwright, fontconfig)",
    "USER": "the user name some libraries read instead of calling getpwuid",
    "LOGNAME": "as USER",
    "LANG": "the locale: text encoding of the server's output and the pages' language",
    "LANGUAGE": "as LANG",
    "LC_ALL": "as LANG",
    "LC_CTYPE": "as LANG",
    "TZ": "the time zone pages see",
    "LD_LIBRARY_PATH": "shared libraries of Chromium in containers that install them off the default path",
    "SSL_CERT_FILE": "the site's certificate authorities, for pages behind a TLS-inspecting gateway",
    "SSL_CERT_DIR": "as SSL_CERT_FILE",
    "HTTP_PROXY": "the site's web proxy: the browser's only way out on some clusters",
    "HTTPS_PROXY": "as HTTP_PROXY",
    "NO_PROXY": "as HTTP_PROXY",
    "ALL_PROXY": "as HTTP_PROXY",
    "http_proxy": "as HTTP_PROXY",
    "https_proxy": "as HTTP_PROXY",
    "no_proxy": "as HTTP_PROXY",
    "all_proxy": "as HTTP_PROXY",
    "NEMO_GYM_BROWSER_PROCESS_MARK": "the submit script's leak check finds the run's processes by it",
    "NEMO_GYM_BROWSER_STEP_MARK": "a Slurm step's stop finds its processes by it",
    "SLURM_JOB_ID": "Slurm's tools and the cluster tests find the job's processes by it",
    "SLURM_STEP_ID": "as SLURM_JOB_ID",
}


def browser_side_environment(environ: Mapping[str, str], **overrides: str) -> dict[str, str]:
    """The variables of :data:`BROWSER_SIDE_VARIABLES` that ``environ`` has, then ``overrides`` (the launcher's own
    settings: temporary folders, the server's config name). Nothing else of ``environ`` passes."""
    kept = {name: environ[name] for name in BROWSER_SIDE_VARIABLES if name in environ}
    return {**kept, **overrides}


def secret_values(environ: Mapping[str, str], names: Iterable[str | None] = ()) -> frozenset[str]:
    """The values of ``environ``'s secret-looking variables and of ``names``, each at least MIN_SECRET_CHARS long."""
    wanted = {name for name in names if name}
    return frozenset(
        value
        for name, value in environ.items()
        if (name in wanted or SECRET_NAME.search(name)) and len(value) >= MIN_SECRET_CHARS
    )


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every occurrence of each secret replaced by :data:`REDACTED` (longest first, so a secret that
    contains another is taken out whole). Apply it before cutting text short: a cut copy no longer matches."""
    for secret in sorted(set(secrets), key=len, reverse=True):
        if secret:
            text = text.replace(secret, REDACTED)
    return text
