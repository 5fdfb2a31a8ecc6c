"""Which URLs the policy may open: public http(s) pages, its task's start page, and what the operator allowed.

Contract: before a ``navigate`` reaches the browser, the URL the policy wrote is refused unless it is http(s) to a
host that is not, and does not resolve to, a non-public address (loopback, link-local, private, carrier-grade NAT,
unspecified, multicast, reserved; ``localhost`` by name), or it is under the origin of the task's start URL, or on
the operator's allow-list (:class:`~nemo_gym_browser.settings.UrlPolicy`). A refusal is a reason the model reads (a
policy error, never an infrastructure failure). A host is read the way Chromium reads it (WHATWG URL standard: every
IPv4 spelling, IPv6 forms that embed an IPv4 address), not the way :mod:`urllib` does.

Limits: names are resolved here, on the trainer's node; DNS rebinding, names that resolve differently on the
environment's node, redirects and clicked links can still reach a private address, so the hard boundary is the
environment hosts' egress rules. In full: ``docs/agent-loop.md#untrusted-navigation``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import posixpath
import re
import socket
import unicodedata
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import unquote, unquote_to_bytes

from .text import shorten

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

WEB_SCHEMES = frozenset({"http", "https"})
DEFAULT_PORTS = {"http": 80, "https": 443}
# Addresses that embed an IPv4 address the browser would actually reach.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# Characters IDNA maps to a full stop (ideographic, fullwidth, halfwidth).
_DOT_LIKE = str.maketrans({"\u3002": ".", "\uff0e": ".", "\uff61": "."})
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")
_C0_OR_SPACE = "".join(chr(c) for c in range(0x21))


class UrlRefused(ValueError):
    """The URL may not be opened; ``str(exc)`` is the reason, written for the model to read."""


@dataclass(frozen=True)
class WebUrl:
    """The parts of an http(s) URL that decide where the browser connects."""

    scheme: str
    host: str  # normalised: lower case, percent-decoded; an IP literal in canonical form (IPv6 in brackets)
    port: int
    address: IPAddress | None  # set when the host is an IP literal in any spelling

    @property
    def origin(self) -> tuple[str, str, int]:
        return (self.scheme, self.host, self.port)


# ----- parsing ------------------------------------------------------------------------------------------------


def _clean(url: str) -> str:
    # WHATWG: strip leading/trailing C0 controls and spaces, drop every tab and newline.
    return url.strip(_C0_OR_SPACE).replace("\t", "").replace("\n", "").replace("\r", "")


def url_scheme(url: str) -> str | None:
    match = _SCHEME.match(_clean(url))
    return match.group(1).lower() if match else None


def _ipv4_number(part: str) -> int | None:
    radix = 10
    if len(part) >= 2 and part[:2] in ("0x", "0X"):
        part, radix = part[2:], 16
    elif len(part) >= 2 and part[0] == "0":
        part, radix = part[1:], 8
    if part == "":
        return 0
    digits = {10: "0123456789", 16: "0123456789abcdefABCDEF", 8: "01234567"}[radix]
    if any(ch not in digits for ch in part):
        return None
    return int(part, radix)


def _whatwg_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address a host denotes, ``None`` when it is a domain name; raises for a malformed numeric host."""
    parts = host.split(".")
    if len(parts) > 1 and parts[-1] == "":
        parts.pop()
    last = parts[-1]
    ends_in_number = last != "" and (last.isdigit() or re.fullmatch(r"0[xX][0-9A-Fa-f]*", last) is not None)
    if not ends_in_number:
        return None
    if len(parts) > 4:
        raise UrlRefused(f"{host!r} is not a valid IPv4 address")
    numbers = [_ipv4_number(part) if part else None for part in parts]
    if any(n is None for n in numbers):
        raise UrlRefused(f"{host!r} is not a valid IPv4 address")
    values = [n for n in numbers if n is not None]
    if any(n > 255 for n in values[:-1]) or values[-1] >= 256 ** (5 - len(values)):
        raise UrlRefused(f"{host!r} is not a valid IPv4 address")
    address = values[-1]
    for index, n in enumerate(values[:-1]):
        address += n * 256 ** (3 - index)
    return ipaddress.IPv4Address(address)


def _normalise_host(raw: str) -> tuple[str, IPAddress | None]:
    if raw.startswith("["):
        if not raw.endswith("]") or "%" in raw:
            raise UrlRefused(f"{raw!r} is not a valid IPv6 address")
        try:
            address = ipaddress.IPv6Address(raw[1:-1])
        except ValueError as exc:
            raise UrlRefused(f"{raw!r} is not a valid IPv6 address") from exc
        return f"[{address.compressed}]", address
    host = unquote_to_bytes(raw).decode("utf-8", errors="replace")
    host = unicodedata.normalize("NFKC", host).translate(_DOT_LIKE).lower()
    if not host or any(ch in host for ch in " /\\?#@[]<>^|%"):
        raise UrlRefused(f"{raw!r} is not a valid host name")
    address = _whatwg_ipv4(host)
    if address is not None:
        return str(address), address
    return host, None


def parse_web_url(url: str) -> WebUrl:
    """Read an http(s) URL's scheme, host and port the way a browser would; raise :class:`UrlRefused` otherwise."""
    cleaned = _clean(url)
    if not cleaned:
        raise UrlRefused("the URL is empty")
    scheme = url_scheme(cleaned)
    if scheme is None:
        raise UrlRefused(f"{_short(url)} is not an absolute URL; write it with http:// or https://")
    if scheme not in WEB_SCHEMES:
        raise UrlRefused(f"the {scheme}: scheme is not allowed; only http and https pages may be opened")
    rest = cleaned[len(scheme) + 1 :].replace("\\", "/").lstrip("/")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    hostport = authority.rsplit("@", 1)[-1]
    if hostport.startswith("["):
        close = hostport.find("]")
        if close < 0:
            raise UrlRefused(f"{_short(url)} has an unterminated IPv6 address")
        raw_host, port_part = hostport[: close + 1], hostport[close + 1 :]
        if port_part and not port_part.startswith(":"):
            raise UrlRefused(f"{_short(url)} has a malformed host")
        port_text = port_part[1:]
    else:
        raw_host, _, port_text = hostport.partition(":")
    if not raw_host:
        raise UrlRefused(f"{_short(url)} has no host")
    if port_text and (not port_text.isdigit() or int(port_text) > 65535):
        raise UrlRefused(f"{_short(url)} has an invalid port")
    host, address = _normalise_host(raw_host)
    port = int(port_text) if port_text else DEFAULT_PORTS[scheme]
    return WebUrl(scheme=scheme, host=host, port=port, address=address)


def _short(url: str, limit: int = 120) -> str:
    return repr(shorten(url, limit))


# ----- addresses ----------------------------------------------------------------------------------------------


def _embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    embedded = []
    if address.ipv4_mapped is not None:
        embedded.append(address.ipv4_mapped)
    if address.sixtofour is not None:
        embedded.append(address.sixtofour)
    if address.teredo is not None:
        embedded.extend(address.teredo)
    if address in _NAT64:
        embedded.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return embedded


def is_public_address(address: IPAddress) -> bool:
    """Globally routable unicast, for the address itself and any IPv4 address it carries."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded:
            return all(is_public_address(v4) for v4 in embedded)
    return address.is_global and not address.is_multicast and not address.is_reserved


def _describe(address: IPAddress) -> str:
    probe = address
    if isinstance(address, ipaddress.IPv6Address) and _embedded_ipv4(address):
        probe = _embedded_ipv4(address)[0]
    for attribute, words in (
        ("is_loopback", "a loopback"),
        ("is_link_local", "a link-local (cloud metadata)"),
        ("is_unspecified", "an unspecified"),
        ("is_multicast", "a multicast"),
        ("is_private", "a private-network"),
    ):
        if getattr(probe, attribute):
            return words
    return "a non-public"


# ----- the allow-list -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _AllowRule:
    scheme: str | None = None
    host: str | None = None
    wildcard: bool = False
    port: int | None = None
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None

    @classmethod
    def parse(cls, entry: str) -> _AllowRule:
        text = str(entry).strip()
        if not text:
            raise ValueError("an empty url_policy.allowlist entry")
        if "/" in text and "://" not in text:
            try:
                return cls(network=ipaddress.ip_network(text, strict=False))
            except ValueError as exc:
                raise ValueError(f"url_policy.allowlist entry {entry!r} is neither a host nor a CIDR network") from exc
        scheme = None
        if "://" in text:
            scheme, _, text = text.partition("://")
            scheme = scheme.lower()
            if scheme not in WEB_SCHEMES:
                raise ValueError(f"url_policy.allowlist entry {entry!r}: only http/https origins can be allowed")
            text = text.rstrip("/")
        wildcard = text.startswith("*.")
        if wildcard:
            text = text[2:]
        if text.startswith("["):
            close = text.find("]")
            host_text, port_text = text[: close + 1], text[close + 2 :] if close + 1 < len(text) else ""
        else:
            host_text, _, port_text = text.partition(":")
        try:
            host, _ = _normalise_host(host_text)
        except UrlRefused as exc:
            raise ValueError(f"url_policy.allowlist entry {entry!r}: {exc}") from exc
        if port_text and not port_text.isdigit():
            raise ValueError(f"url_policy.allowlist entry {entry!r} has an invalid port")
        port = int(port_text) if port_text else (DEFAULT_PORTS[scheme] if scheme else None)
        return cls(scheme=scheme, host=host, wildcard=wildcard, port=port)

    def matches(self, url: WebUrl) -> bool:
        if self.network is not None:
            return url.address is not None and url.address in self.network
        if self.scheme is not None and self.scheme != url.scheme:
            return False
        if self.port is not None and self.port != url.port:
            return False
        if self.wildcard:
            return url.host == self.host or url.host.endswith("." + (self.host or ""))
        return url.host == self.host

    def covers_address(self, address: IPAddress) -> bool:
        return self.network is not None and address in self.network


def validate_allow_entry(entry: str) -> None:
    """Raise ``ValueError`` (naming the entry) when ``entry`` is not a valid ``url_policy.allowlist`` entry."""
    _AllowRule.parse(entry)


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address the system resolver gives for ``host`` (no timeout here; the caller bounds it)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


# ----- the guard ----------------------------------------------------------------------------------------------


class GuardPolicy(Protocol):
    """What the guard reads of the operator's policy (:class:`~nemo_gym_browser.settings.UrlPolicy` has it)."""

    @property
    def allow_private_networks(self) -> bool: ...
    @property
    def allowlist(self) -> tuple[str, ...]: ...
    @property
    def resolve_hostnames(self) -> bool: ...
    @property
    def dns_timeout_s(self) -> float: ...


class UrlGuard:
    """Decides one episode's navigations. Built per episode from the operator's policy and the task's start URL."""

    def __init__(self, policy: GuardPolicy, start_url: str | None = None, *, resolver: Resolver | None = None) -> None:
        self.policy = policy
        self._rules = [_AllowRule.parse(entry) for entry in policy.allowlist]
        self._resolver = resolver or system_resolver
        self._start_origin: tuple[str, str, int] | None = None
        self._start_dir: str | None = None
        if start_url:
            self.note_start_page(start_url)

    def note_start_page(self, url: str) -> None:
        """Honour ``url`` as the task's start page (its origin, or its directory for a ``file:`` page)."""
        scheme = url_scheme(url)
        if scheme in WEB_SCHEMES:
            try:
                self._start_origin = parse_web_url(url).origin
            except UrlRefused:
                pass
        elif scheme == "file":
            directory = _file_path(url)
            if directory is not None:
                self._start_dir = posixpath.dirname(directory)

    @property
    def knows_start_page(self) -> bool:
        return self._start_origin is not None or self._start_dir is not None

    async def check(self, url: str) -> None:
        """Return when ``url`` may be opened; raise :class:`UrlRefused` with the reason otherwise."""
        if not isinstance(url, str):
            raise UrlRefused("the url must be a string")
        scheme = url_scheme(url)
        if scheme == "file":
            path = _file_path(url)
            if self._start_dir is not None and path is not None and _is_within(path, self._start_dir):
                return
            raise UrlRefused("the file: scheme is not allowed; only http and https pages may be opened")
        target = parse_web_url(url)
        if target.origin == self._start_origin or any(rule.matches(target) for rule in self._rules):
            return
        if self.policy.allow_private_networks:
            return
        if target.address is not None:
            self._check_address(target.address, target.host)
            return
        if target.host == "localhost" or target.host.endswith(".localhost") or target.host.rstrip(".") == "localhost":
            raise UrlRefused(f"{target.host} is a loopback name; only public addresses may be opened")
        if self.policy.resolve_hostnames:
            for address in await self._resolve(target.host, target.port):
                self._check_address(address, target.host)

    def _check_address(self, address: IPAddress, host: str) -> None:
        if is_public_address(address) or any(rule.covers_address(address) for rule in self._rules):
            return
        shown = host if host.strip("[]") == str(address) else f"{host} ({address})"
        raise UrlRefused(f"{shown} is {_describe(address)} address; only public addresses may be opened")

    async def _resolve(self, host: str, port: int) -> list[IPAddress]:
        try:
            answers = await asyncio.wait_for(self._resolver(host.rstrip("."), port), self.policy.dns_timeout_s)
        except (TimeoutError, OSError, UnicodeError) as exc:
            raise UrlRefused(f"the host {host} could not be resolved") from exc
        addresses: list[IPAddress] = []
        for answer in answers:
            try:
                addresses.append(ipaddress.ip_address(answer.split("%", 1)[0]))
            except ValueError:
                continue
        if not addresses:
            raise UrlRefused(f"the host {host} could not be resolved")
        return addresses


def _file_path(url: str) -> str | None:
    """The normalised local path of a ``file:`` URL with an empty or ``localhost`` host, else ``None``."""
    rest = _clean(url)[len("file:") :].replace("\\", "/")
    if rest.startswith("//"):
        host, _, path = rest[2:].partition("/")
        if host not in ("", "localhost"):
            return None
        rest = "/" + path
    path = unquote(re.split(r"[?#]", rest, maxsplit=1)[0])
    return posixpath.normpath(path) if path.startswith("/") else None


def _is_within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")
