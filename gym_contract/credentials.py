"""Credentials stay where they are needed: what a browser-side process may inherit, and what logs must not show.

What this module owns
    * The environment of the processes that render untrusted pages, the NeMo Gym server and its Chromium
      (:func:`browser_side_environment`): an allow-list, :data:`BROWSER_SIDE_VARIABLES`, never a copy of ours. A
      page the policy opened runs in that Chromium, and a server exploit would read the server's environment, so
      the judge key, ``HF_TOKEN``, ``WANDB_API_KEY``, ``RAY_AUTH_TOKEN`` and anything else of the trainer's stay out.
    * Which values are secrets (:func:`secret_values`): variables whose name says so (``*_TOKEN``, ``*_KEY``,
      ``*SECRET*``, ``*PASSWORD*``, ...) and any the caller names (the judge's ``api_key_env``).
    * Taking them out of text a server sent before it is logged or stored (:func:`redact`): an endpoint may echo a
      request header, or any value it learnt, into an error body; and the user and password a URL may carry
      (``http://user:pass@proxy:3128``) out of any text that shows one (:func:`redact_url_credentials`).
    * The web proxy (:data:`PROXY_VARIABLES`): the browser side keeps the site's proxy, its only way to the task sites
      on some clusters, and never sends loopback through it (:func:`browser_side_environment` adds loopback to
      ``NO_PROXY``/``no_proxy``): Playwright's CDP connection to the server's own Chromium honours those variables
      and would otherwise ask the site's proxy for ``127.0.0.1``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

REDACTED = "***"
# Shorter values are not redacted: replacing "1" or "true" everywhere would garble every log line, and a secret that
# short is no secret.
MIN_SECRET_CHARS = 8
SECRET_NAME = re.compile(r"(TOKEN|_KEY$|^KEY$|API_?KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)

# The proxy variables, in both spellings: programs differ in which one they read first (Playwright the lower-case one).
PROXY_VARIABLES = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
)
# Never through a proxy: the server's own Chromium (CDP) and task sites served on the node itself.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# The user and password of a URL: up to its last "@" before the path, so a password with an "@" in it goes whole.
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)[^/\s]*@")

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
    settings: temporary folders, the server's config name). Nothing else of ``environ`` passes. With a proxy set,
    ``NO_PROXY`` and ``no_proxy`` both hold every host either named, and loopback."""
    kept = {name: environ[name] for name in BROWSER_SIDE_VARIABLES if name in environ}
    return {**kept, **_loopback_bypass(kept), **overrides}


def _loopback_bypass(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``NO_PROXY``/``no_proxy`` pair that keeps loopback off a proxy ``environ`` sets; {} without a proxy."""
    if not any(environ.get(name) for name in PROXY_VARIABLES if name.upper() != "NO_PROXY"):
        return {}
    hosts: list[str] = []
    for value in (environ.get("NO_PROXY", ""), environ.get("no_proxy", ""), ",".join(LOOPBACK_HOSTS)):
        hosts += [host for host in re.split(r"[,\s]+", value) if host and host not in hosts]
    joined = ",".join(hosts)
    return {"NO_PROXY": joined, "no_proxy": joined}


def proxy_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The proxy variables a browser-side process gets from ``environ`` (:func:`browser_side_environment`), each value
    with a URL's user and password taken out: fit to print."""
    kept = browser_side_environment(environ)
    return {name: redact_url_credentials(kept[name]) for name in PROXY_VARIABLES if kept.get(name)}


def redact_url_credentials(text: str) -> str:
    """``text`` with the ``user:password@`` of every ``scheme://`` URL in it replaced by :data:`REDACTED`."""
    return _URL_USERINFO.sub(lambda match: f"{match['scheme']}{REDACTED}@", text)


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
