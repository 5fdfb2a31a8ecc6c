"""Policy navigation is untrusted: what the URL guard refuses and what it honours, read the way a browser reads it."""

from __future__ import annotations

import asyncio

import pytest

from nemo_gym_browser.agent_attempt.episode import BrowserEpisode
from nemo_gym_browser.gym_contract.environment import ToolResult
from nemo_gym_browser.gym_contract.url_safety import UrlGuard, UrlRefused, is_public_address, parse_web_url
from nemo_gym_browser.settings import UrlPolicy

PUBLIC = "93.184.216.34"
DNS = {
    "public.example": [PUBLIC],
    "metadata.internal.example": ["169.254.169.254"],
    "split.example": [PUBLIC, "10.0.0.5"],  # one private answer is enough to refuse (rebinding-style)
    "v6private.example": ["fd00::1"],
    "v6public.example": ["2001:4860:4860::8888"],
}


async def fake_resolver(host: str, port: int) -> list[str]:
    if host == "slow.example":
        await asyncio.sleep(10)
    if host not in DNS:
        raise OSError("name not known")
    return DNS[host]


def guard(start_url: str | None = "http://127.0.0.1:9000/index.html", **policy) -> UrlGuard:
    return UrlGuard(UrlPolicy(dns_timeout_s=0.2, **policy), start_url, resolver=fake_resolver)


REFUSED = [
    # non-web schemes
    ("file:///etc/passwd", "file: scheme"),
    ("FILE:///etc/passwd", "file: scheme"),
    ("javascript:alert(document.cookie)", "javascript: scheme"),
    ("chrome://settings", "chrome: scheme"),
    ("data:text/html,<script>1</script>", "data: scheme"),
    ("about:blank", "about: scheme"),
    ("view-source:http://example.com", "view-source: scheme"),
    ("ftp://example.com/", "ftp: scheme"),
    ("example.com", "not an absolute URL"),
    ("", "empty"),
    # loopback in every spelling Chromium accepts
    ("http://127.0.0.1:9001/", "loopback"),
    ("http://2130706433/", "loopback"),
    ("http://0x7f000001/", "loopback"),
    ("http://0x7f.1/", "loopback"),
    ("http://0177.0.0.1/", "loopback"),
    ("http://127.1/", "loopback"),
    ("http://127.0.0.1./", "loopback"),
    ("http://%31%32%37.0.0.1/", "loopback"),
    ("http://１２７。０。０。１/", "loopback"),
    ("http://[::1]/", "loopback"),
    ("http://[::ffff:127.0.0.1]/", "loopback"),
    ("http://[::ffff:7f00:1]/", "loopback"),
    ("http://localhost/", "loopback name"),
    ("http://LOCALHOST:8080/", "loopback name"),
    ("http://app.localhost/", "loopback name"),
    # parser confusions: the browser connects to the host after the last '@', and '\' is '/'
    ("http://public.example@127.0.0.1/", "loopback"),
    ("http://127.0.0.1\\@public.example/", "loopback"),
    ("http://\t127.0.0.1/", "loopback"),
    ("  http://127.0.0.1/  ", "loopback"),
    # cloud metadata and private networks
    ("http://169.254.169.254/latest/meta-data/", "link-local (cloud metadata)"),
    ("http://[64:ff9b::a9fe:a9fe]/", "link-local (cloud metadata)"),  # NAT64
    ("http://[2002:a9fe:a9fe::]/", "link-local (cloud metadata)"),  # 6to4
    ("http://10.1.2.3/", "private-network"),
    ("http://172.16.0.1/", "private-network"),
    ("http://192.168.1.1/", "private-network"),
    ("http://[fc00::1]/", "private-network"),
    ("http://100.64.0.1/", "non-public"),  # carrier-grade NAT
    ("http://0.0.0.0/", "unspecified"),
    ("http://[::]/", "unspecified"),
    ("http://224.0.0.1/", "multicast"),
    # names whose addresses are not public
    ("https://metadata.internal.example/", "link-local"),
    ("https://split.example/", "private-network"),
    ("https://v6private.example/", "private-network"),
    ("https://unknown.example/", "could not be resolved"),
    ("https://slow.example/", "could not be resolved"),
    # malformed hosts
    ("http://256.1.1.1/", "not a valid IPv4"),
    ("http://1.2.3.4.5/", "not a valid IPv4"),
    ("http://[fe80::1%25eth0]/", "not a valid IPv6"),
    ("http://:80/", "no host"),
    ("http:///internal-name", "could not be resolved"),  # read as http://internal-name/, as Chromium does
    ("http://public.example:99999/", "invalid port"),
]


@pytest.mark.parametrize(("url", "reason"), REFUSED)
async def test_a_non_public_or_non_web_url_is_refused_with_a_reason_the_model_can_read(url, reason):
    with pytest.raises(UrlRefused, match=reason.replace("(", r"\(").replace(")", r"\)")):
        await guard().check(url)


ALLOWED = [
    "http://127.0.0.1:9000/about.html",  # the start page's origin
    "https://public.example/path?q=1",
    "HTTPS://PUBLIC.EXAMPLE/",
    "https://v6public.example/",
    f"http://{PUBLIC}/",
    f"http:{PUBLIC}",  # Chromium reads a missing '//' for http as an authority
    "http://[2001:4860:4860::8888]/",
]


@pytest.mark.parametrize("url", ALLOWED)
async def test_public_web_urls_and_the_start_pages_origin_are_allowed(url):
    await guard().check(url)


@pytest.mark.parametrize(
    ("entry", "allowed", "still_refused"),
    [
        ("*.corp.example", "http://wiki.corp.example/", "http://corp.example.evil/"),
        ("http://10.1.2.3:8080", "http://10.1.2.3:8080/x", "http://10.1.2.3/x"),
        ("192.168.7.0/24", "http://192.168.7.9/", "http://192.168.8.9/"),
        ("localhost:3000", "http://localhost:3000/", "http://localhost:3001/"),
    ],
)
async def test_the_allow_list_opens_exactly_what_it_names(entry, allowed, still_refused):
    DNS["wiki.corp.example"] = ["10.9.9.9"]
    try:
        g = guard(allowlist=[entry])
        await g.check(allowed)
        with pytest.raises(UrlRefused):
            await g.check(still_refused)
    finally:
        del DNS["wiki.corp.example"]


async def test_a_file_start_page_allows_its_own_folder_and_nothing_outside_it():
    g = guard("file:///srv/site/index.html")

    await g.check("file:///srv/site/about.html")
    await g.check("file:///srv/site/sub/page.html")
    for outside in ("file:///srv/other/x.html", "file:///srv/site/../../etc/passwd", "file://host/srv/site/a.html"):
        with pytest.raises(UrlRefused, match="file: scheme"):
            await g.check(outside)


async def test_allowing_private_networks_still_refuses_non_web_schemes():
    g = guard(allow_private_networks=True)

    await g.check("http://10.0.0.1/")
    await g.check("http://localhost/")
    with pytest.raises(UrlRefused, match="file: scheme"):
        await g.check("file:///etc/passwd")


async def test_without_name_resolution_only_literal_addresses_and_loopback_names_are_checked():
    g = guard(resolve_hostnames=False)

    await g.check("https://metadata.internal.example/")  # not resolved here: the documented limit
    with pytest.raises(UrlRefused):
        await g.check("http://169.254.169.254/")


def test_a_malformed_allow_list_entry_raises_at_start_up():
    with pytest.raises(ValueError, match="allowlist entry"):
        UrlPolicy(allowlist=["ftp://files.example"])
    with pytest.raises(ValueError, match="allowlist entry"):
        UrlPolicy(allowlist=["10.0.0.0/33"])


def test_hosts_are_read_as_the_browser_reads_them():
    assert parse_web_url("http://0x7f.1:8080/a").host == "127.0.0.1"
    assert parse_web_url("http://0x7f.1:8080/a").port == 8080
    assert parse_web_url("HTTPS://Example.COM./").origin == ("https", "example.com.", 443)
    assert parse_web_url("http://user:pw@[::ffff:10.0.0.1]:81/").host == "[::ffff:a00:1]"


@pytest.mark.parametrize(
    ("address", "public"),
    [("8.8.8.8", True), ("127.0.0.1", False), ("::ffff:8.8.8.8", True), ("::ffff:10.0.0.1", False), ("fe80::1", False)],
)
def test_embedded_ipv4_addresses_decide_for_their_ipv6_form(address, public):
    import ipaddress

    assert is_public_address(ipaddress.ip_address(address)) is public


class _RedirectingSession:
    """A session whose every action lands on ``landing`` (a redirect the page chose), observed in its answer."""

    def __init__(self, landing: str) -> None:
        self.landing = landing
        self.calls: list[str] = []

    async def call(self, tool: str, arguments: dict) -> ToolResult:
        self.calls.append(tool)
        return ToolResult(observation=f"URL: {self.landing}\nTITLE: t\nELEMENTS:\nTEXT: page")


@pytest.mark.parametrize("start_url", [None, "site/index.html"])
async def test_a_navigations_redirect_target_is_never_adopted_as_the_start_page(start_url):
    session = _RedirectingSession("http://10.1.2.3/admin")
    episode = BrowserEpisode(
        session=session,
        guard=UrlGuard(UrlPolicy(), start_url),
        deadline_s=60,
        hold_limit_s=120,
        call_bound_s=10,
        label="redirect",
    )

    await episode.act("browser_navigate", {"url": "http://93.184.216.34/"})  # public; the page redirects
    refused = await episode.act("browser_navigate", {"url": "http://10.1.2.3/secrets"})

    assert not episode.guard.knows_start_page
    assert refused.startswith("Error: navigation refused") and episode.refused_navigations == 1
    assert session.calls == ["browser_navigate"]


async def test_the_start_page_as_seeded_is_learnt_from_the_first_observation():
    session = _RedirectingSession("http://10.1.2.3/start")
    episode = BrowserEpisode(
        session=session, guard=UrlGuard(UrlPolicy(), "site/index.html"), deadline_s=60, hold_limit_s=120,
        call_bound_s=10, label="seeded",
    )  # fmt: skip

    await episode.act("browser_observe", {})

    assert episode.guard.knows_start_page
    assert not (await episode.act("browser_navigate", {"url": "http://10.1.2.3/other"})).startswith("Error")
