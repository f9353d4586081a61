"""SSRF guard for callback URLs: never aim a webhook inside the network unless the operator allows it.

Two checks:
- at submit (`check_url`): the URL must be http(s) with a host, and a host that is an IP literal in
  any spelling (dotted, decimal `2852039166`, octal `0251.0376.0251.0376`, hex `0xa9fea9fe`,
  IPv6, IPv4-mapped IPv6 `[::ffff:a9fe:a9fe]`) must be a public address;
- at delivery (`resolve_and_check`): the host is resolved once, every address it resolves to must be
  public, and the caller connects to the checked address (no second resolution, so DNS rebinding
  cannot swap it).
"Public" means `ipaddress`'s `is_global` and not multicast: loopback, private ranges, link-local
(169.254.169.254, the cloud metadata address, included), shared, reserved and unspecified addresses
are refused, also when embedded in IPv6 (mapped, 6to4, Teredo). An operator allow-list of host names
and networks (`BATCHGATE_CALLBACK_ALLOW`) overrides the refusal, with limits: entries are validated
(a bad network is an error, not a host name), entries wide enough to turn the guard off need
`force:`, link-local and metadata addresses stay refused unless an entry names them, an allowed host
name still has its resolved addresses checked against link-local/metadata, and obviously internal
names (`localhost`, a name of one label, `*.localhost`, `*.internal`, `*.local`, `*.home.arpa`, and the
never-delegated `*.lan`, `*.home`, `*.corp`, `*.localdomain`) are refused unless allowed. Messages
never name server environment variables (they reach API callers).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]
MAX_URL_LENGTH = 2048


class RefusedURL(ValueError):
    """A callback URL that batchgate will not call."""


class ResolveFailed(RefusedURL):
    """The host did not resolve right now (may be temporary: the dispatcher retries)."""


@dataclass(frozen=True, slots=True)
class Target:
    """A checked destination: connect to `ip`, send `Host: host`."""

    url: str
    scheme: str
    host: str
    port: int
    ip: str
    path: str


# link-local and cloud metadata: refused even when a wider allow-list entry covers them, unless an entry
# names (a part of) one of these networks itself
SENSITIVE = tuple(ipaddress.ip_network(n) for n in (
    "169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128", "::ffff:169.254.0.0/112"))
# obviously internal host names: refused at submit (422) unless allow-listed
INTERNAL_SUFFIXES = (".localhost", ".internal", ".local", ".home.arpa", ".lan", ".home", ".corp", ".localdomain")
FORCE = "force:"
_LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
_HOST_RE = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")


def _too_wide(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    """A network so wide that allowing it turns the guard off (0.0.0.0/0, ::/0, 0.0.0.0/1, ...), IPv6 ones
    carrying IPv4 included: an entry that covers a /8 or more of IPv4 through an embedding (`::ffff:0:0/96`,
    `64:ff9b::/96`, `::/96`, `2002::/16`, or `::/80` around them) is as wide as `0.0.0.0/8`. A part of a
    link-local or metadata network is named on purpose (`fe80::/10`), never too wide."""
    if net.version == 4:
        return net.prefixlen < 8
    if any(net.subnet_of(s) for s in SENSITIVE if s.version == 6):  # type: ignore[arg-type]
        return False
    if net.prefixlen < 16:
        return True
    for embedding, v4_at in _EMBEDDINGS:
        if net.supernet_of(embedding) or (net.subnet_of(embedding) and net.prefixlen - v4_at < 8):
            return True
    return False


@dataclass(frozen=True)
class AllowList:
    hosts: frozenset[str] = frozenset()
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = field(default_factory=tuple)
    forced: tuple[str, ...] = ()  # guard-disabling entries the operator forced with `force:`

    @classmethod
    def parse(cls, raw: str) -> AllowList:
        """Comma-separated host names, addresses and networks. Raises ValueError on an entry that is none of
        these (`10.20.0.0/33`, `10.1.2.300`, `hooks example`) and on one wide enough to turn the guard off
        (`0.0.0.0/0`, `::/0`) unless written `force:0.0.0.0/0`."""
        hosts, nets, forced = set(), [], []
        for item in filter(None, (p.strip() for p in raw.split(","))):
            force = item.lower().startswith(FORCE)
            entry = item[len(FORCE):].strip() if force else item
            looks_numeric = "/" in entry or ":" in entry or re.fullmatch(r"[0-9.]+", entry) is not None
            if looks_numeric:
                try:
                    net = ipaddress.ip_network(entry, strict=False)
                except ValueError as exc:
                    raise ValueError(f"callback allow-list entry {item!r} is not a valid address or network: "
                                     f"{exc}") from exc
                if _too_wide(net):
                    if not force:
                        raise ValueError(f"callback allow-list entry {item!r} allows (nearly) every address and "
                                         f"turns the SSRF guard off; write {FORCE}{entry} if that is meant")
                    forced.append(str(net))
                nets.append(net)
                continue
            name = entry.lower().rstrip(".")
            if not _HOST_RE.match(name):
                raise ValueError(f"callback allow-list entry {item!r} is neither a host name nor a network")
            hosts.add(name)
        return cls(frozenset(hosts), tuple(nets), tuple(forced))

    def describe(self) -> list[str]:
        return sorted(self.hosts) + [str(n) for n in self.networks]

    def log_effective(self, logger: Any, who: str) -> None:
        """Start-up: the effective list at info, and a loud warning for each forced guard-disabling entry."""
        logger.info("callback allow-list", component=who, entries=self.describe() or "(none: only public "
                    "addresses)")
        for net in self.forced:
            logger.warning("callback allow-list entry turns the SSRF guard off (forced)", component=who,
                           entry=net, still_refused="link-local and metadata addresses")

    def allows_host(self, host: str) -> bool:
        return host.lower().rstrip(".") in self.hosts

    def allows_ip(self, ip: IPAddress) -> bool:
        sensitive = is_sensitive(ip)
        for n in self.networks:
            named = any(n.version == s.version and n.subnet_of(s) for s in SENSITIVE)  # type: ignore[arg-type]
            if ip.version == n.version and ip in n and (not sensitive or named):
                return True
        return False


def is_sensitive(ip: IPAddress) -> bool:
    """Link-local or a cloud metadata address, in any embedding."""
    return any(a.version == s.version and a in s for a in _embedded(ip) for s in SENSITIVE)


def is_internal_name(host: str) -> bool:
    h = host.lower().rstrip(".")
    return "." not in h or h.endswith(INTERNAL_SUFFIXES)  # one label (`intranet`): only a local resolver knows it


def literal_ip(host: str) -> IPAddress | None:
    """The address a host string denotes if it is an IP literal in any spelling, else None."""
    h = host.strip("[]")
    try:
        return ipaddress.ip_address(h)
    except ValueError:
        pass
    try:  # inet_aton accepts what resolvers accept: 2852039166, 0251.0376.0251.0376, 0xa9fea9fe, 10.1
        return ipaddress.IPv4Address(socket.inet_aton(h))
    except (OSError, ValueError):  # ValueError: embedded NUL
        return None


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # well-known NAT64 prefix: DNS64 networks route it to IPv4
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")
_SIIT = ipaddress.IPv6Network("::ffff:0:0:0/96")  # IPv4-translated
_V4_COMPAT = ipaddress.IPv6Network("::/96")  # deprecated IPv4-compatible
# IPv6 networks that carry IPv4 addresses, and the bit where the IPv4 address begins (conservatively, for
# Teredo's and NAT64's local-use prefix, whose IPv4 bits sit in several places)
_EMBEDDINGS = ((ipaddress.IPv6Network("::ffff:0:0/96"), 96), (_V4_COMPAT, 96), (_NAT64, 96), (_SIIT, 96),
               (ipaddress.IPv6Network("2002::/16"), 16), (ipaddress.IPv6Network("2001::/32"), 96),
               (_NAT64_LOCAL, 96))


def _embedded(ip: IPAddress) -> list[IPAddress]:
    """The address itself and every IPv4 address it can carry (mapped, 6to4, Teredo, NAT64, SIIT, compatible)."""
    out: list[IPAddress] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        for v4 in (ip.ipv4_mapped, ip.sixtofour, ip.teredo[1] if ip.teredo else None):
            if v4 is not None:
                out.append(v4)
        if any(ip in net for net in (_NAT64, _NAT64_LOCAL, _SIIT, _V4_COMPAT)):
            out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return out


def is_public(ip: IPAddress) -> bool:
    return all(a.is_global and not a.is_multicast and not getattr(a, "is_site_local", False) for a in _embedded(ip))


def check_ip(ip: IPAddress, allow: AllowList) -> None:
    if allow.allows_ip(ip) or is_public(ip):
        return
    raise RefusedURL(f"address {ip} is not public (loopback, private, link-local, metadata, multicast or "
                     "reserved); the operator's callback allow-list can allow it")


def _split(url: str) -> tuple[str, str, int, str]:
    if not isinstance(url, str) or not url:
        raise RefusedURL("callback url is empty: give the http(s) URL to send webhooks to")
    if len(url) > MAX_URL_LENGTH:
        raise RefusedURL(f"callback url must be a string of at most {MAX_URL_LENGTH} characters")
    if any(c.isspace() for c in url):  # no request can carry it (a host with a space never resolves)
        raise RefusedURL("callback url must not contain spaces or other white space (percent-encode them in its "
                         "path)")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise RefusedURL(f"callback url does not parse: {exc}") from exc
    if parts.scheme not in ("http", "https"):
        raise RefusedURL("callback url must be http or https")
    host = _host(parts.hostname)
    if not host:
        raise RefusedURL("callback url needs a host")
    if parts.username or parts.password:
        raise RefusedURL("callback url must not carry credentials")
    if port == 0:  # nothing listens there: every attempt would fail, for hours
        raise RefusedURL("callback url port must be 1-65535")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return parts.scheme, host, port or (443 if parts.scheme == "https" else 80), path


def _host(hostname: str | None) -> str:
    """A URL's host as it is resolved and checked: lower case (`urlsplit`'s), without the root's trailing dot
    (`example.com.` is `example.com`; `127.0.0.1.` resolves nowhere, as an IP literal it is that IP)."""
    return (hostname or "").removesuffix(".")


def normalized_url(url: str) -> str:
    """A callback URL as it is stored and compared (a URL a receiver disabled with 410 stays disabled however it
    is spelled): scheme and host in lower case, the host without its trailing dot, no fragment (never sent: a
    fragment made a disabled URL a new one); the path and query as given."""
    parts = urlsplit(url)
    host = _host(parts.hostname)
    host = f"[{host}]" if ":" in host else host
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return urlunsplit((parts.scheme.lower(), netloc, parts.path, parts.query, ""))


def check_url(url: str, allow: AllowList) -> None:
    """The submit-time check: well-formed http(s), and no IP literal aimed inside."""
    _, host, _, _ = _split(url)
    if allow.allows_host(host):
        return
    ip = literal_ip(host)
    if ip is not None:
        check_ip(ip, allow)
    elif is_internal_name(host):
        raise RefusedURL(f"host {host} is an internal name (one label, *.internal, *.local, *.lan, ...); the "
                         "operator's callback allow-list can allow it")


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def resolve_and_check(url: str, allow: AllowList, resolver: Resolver = system_resolver) -> Target:
    """The delivery-time check: resolve once, refuse if any address is not public, pin the first."""
    scheme, host, port, path = _split(url)
    ip = literal_ip(host)
    if ip is not None:
        addresses: Iterable[IPAddress] = [ip]
    else:
        try:
            addresses = [ipaddress.ip_address(a.split("%")[0]) for a in resolver(host, port)]
        except (OSError, ValueError) as exc:
            raise ResolveFailed(f"cannot resolve {host}: {exc}") from exc
    addresses = list(addresses)
    if not addresses:
        raise ResolveFailed(f"{host} resolves to no address")
    named = allow.allows_host(host)
    if not named and ip is None and is_internal_name(host):
        raise RefusedURL(f"host {host} is an internal name; the operator's callback allow-list can allow it")
    for a in addresses:
        if named:  # an allowed name may resolve inside, but never to link-local/metadata unless that is allowed
            if is_sensitive(a) and not allow.allows_ip(a):
                raise RefusedURL(f"{host} resolves to {a}, a link-local or metadata address; allow-listing the "
                                 "name does not allow that address")
        else:
            check_ip(a, allow)
    return Target(url=url, scheme=scheme, host=host, port=port, ip=str(addresses[0]), path=path)
