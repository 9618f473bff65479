"""Egress by name (issue 28): a session's allowed destinations, and the verdicts on them.

What the egress proxy asks, in one place and without I/O: is this CONNECT (host, port)
allowed, and by which rule; is this plain HTTP request (method, path) allowed; may the
address the proxy resolved a name to be dialled; do a tunnel's CONNECT host and its TLS
SNI agree. Every refusal says which rule or which check refused it, in words a person
reading a 403 in a kernel understands. The proxy itself (not built yet) resolves names,
dials and relays; this module only decides.

A rule names a host exactly (`api.example.com`) or a suffix (`*.example.com`: any name
with at least one more label, never `example.com` itself), the ports it may be reached on
(443 unless said), and optionally the methods and path prefixes a request may use. A rule
with methods or paths can only be held where the proxy reads the request: plain HTTP,
or a tunnel it terminates (a destination with a secret added on the way out); a tunnel it
cannot read is refused rather than let through unchecked.

Names are compared in their ASCII form (IDNA), lowercased, without a trailing dot. An IP
literal is never a destination: rules name hosts, and a request for an address is
refused. An address a name resolves to is refused when it is not globally routable
(loopback, private, link-local and so the cloud metadata address, shared, multicast,
reserved; an IPv4 address carried in IPv6, mapped, NAT64, 6to4 or Teredo, is judged as
itself) or is in the cluster's own
ranges, unless the rule that allowed the name lists a range holding it (`addresses`).
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mcp_forge.errors import InvalidSession

RULES_MAX = 64  # rules per session: a list to read, not a database
HOST_MAX = 253
PATHS_MAX = 16
PATH_MAX = 1024
ADDRESSES_MAX = 16
DEFAULT_PORTS = (443,)
INJECT_MAX = 4  # values added per destination
VALUE_MAX = 8192  # one added value, in bytes
_HEADER = re.compile(r"[A-Za-z0-9!#$&'*+.^_`|~-]{1,64}")  # an HTTP token (RFC 9110)
_QUERY = re.compile(r"[A-Za-z0-9._~-]{1,64}")
_USER = re.compile(r"[\x21-\x39\x3b-\x7e]{1,128}")  # printable ASCII but ':'
_PREFIX = re.compile(r"[\x20-\x7e]{0,64}")
_SECRET_NAME = re.compile(r"[A-Za-z0-9._-]{1,253}")
_WHAT = {"header": "header name", "query": "query parameter name", "basicAuth": "user name"}
# Headers that frame or route the request, or speak to the proxy: never a secret's.
_HEADERS_KEPT = frozenset(
    ("host", "content-length", "transfer-encoding", "connection", "upgrade", "te",
     "trailer", "keep-alive", "proxy-authorization", "proxy-connection", "expect")
)  # fmt: skip
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")  # fullmatch: no "\n" after
_NUMBER = re.compile(r"[0-9]+|0x[0-9a-f]*")
# Segments a server may normalize away or decode into one: a prefix check is blind to them.
_DOT_SEGMENT = re.compile(r"(^|/)\.\.?(/|$)")
# What a server may read otherwise than a prefix check does: dot segments, separators
# and parameters (';', Tomcat's and Spring's), fragments, escapes left after one
# decoding (double encoding), backslashes, controls, spaces and non-ASCII (overlong or
# fullwidth dots).
_UNCLEAR = re.compile(r"[%\\;#?\x00-\x20\x7f]")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052's well-known prefix
_REFUSED_V6 = tuple(
    ipaddress.IPv6Network(n)
    for n in ("::/96", "::ffff:0:0:0/96", "64:ff9b:1::/48")  # compatible, SIIT, local NAT64
)
_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")
_SPECIAL = tuple(
    ipaddress.ip_network(n)
    for n in (
        "192.0.0.0/24",  # IETF protocol assignments
        "192.88.99.0/24",  # 6to4 relays (deprecated)
        "2001::/23",  # IETF protocol assignments (Teredo is unwrapped before)
        "2001:db8::/32",  # documentation
        "3fff::/20",  # documentation
    )
)
# Ranges no rule's `addresses` may overlap.
_NEVER = tuple(
    ipaddress.ip_network(n)
    for n in ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "::/96", "::ffff:0:0/96",
              "::ffff:0:0:0/96", "fe80::/10")
)  # fmt: skip


@dataclass(frozen=True)
class Injection:
    """A value from a Secret the proxy adds to a destination's requests, on the way out:
    a header (`prefix` + value), a query parameter, or basic auth (`name` the user, the
    value the password). The kernel never holds the value."""

    kind: str  # "header", "query" or "basicAuth"
    name: str  # the header, the parameter, or the basic-auth user
    secret: str  # the Secret's name, in the session's namespace
    key: str
    prefix: str = ""  # headers only: "Bearer " and the like


@dataclass(frozen=True)
class Rule:
    """One allowed destination; `number` is its place in the list, from 1 (for messages)."""

    number: int
    host: str  # normalized; "*.suffix" for a wildcard
    ports: tuple[int, ...] = DEFAULT_PORTS
    methods: tuple[str, ...] = ()  # empty: any
    paths: tuple[str, ...] = ()  # prefixes; empty: any
    addresses: tuple[Network, ...] = ()  # non-global ranges this host may resolve into
    inject: tuple[Injection, ...] = ()  # values added to its requests on the way out

    @property
    def reads_requests(self) -> bool:
        """Whether the proxy must read the rule's requests: to check their methods or
        paths, or to add a secret to them."""
        return bool(self.methods or self.paths or self.inject)

    def label(self) -> str:
        return f"rule {self.number} ({self.host})"

    def matches(self, host: str, port: int) -> bool:
        if port not in self.ports:
            return False
        if self.host.startswith("*."):
            return host.endswith(self.host[1:]) and len(host) > len(self.host) - 1
        return host == self.host


@dataclass(frozen=True)
class Verdict:
    """The answer: allowed or not, the rule that decided (if one did), and why, in words."""

    allowed: bool
    reason: str
    rule: Rule | None = None
    inspect: bool = False  # allowed only if the proxy reads the requests (see Rule)


# ---- names -------------------------------------------------------------------------------


def ip_literal(host: str) -> Address | None:
    """The address `host` spells (with or without IPv6 brackets), or None for a name."""
    text = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


def normalize_host(host: str) -> str:
    """`host` as rules and requests are compared: lowercase ASCII, no trailing dot.
    ValueError says what is wrong with it (an IP literal or a number, a bad label, its
    length). A name in Unicode is refused: IDNA 2003 and 2008 map some differently (faß),
    so only its A-label (xn--...) says which name is meant, and clients send that."""
    if ip_literal(host) is not None:
        raise ValueError("an IP address, not a host name")
    if not host.isascii():
        raise ValueError("not ASCII: write the name's A-label (xn--...)")
    name = host[:-1] if host.endswith(".") else host
    name = name.lower()
    if not name or len(name) > HOST_MAX:
        raise ValueError(f"a host name is 1 to {HOST_MAX} characters")
    labels = name.split(".")
    bad = [label for label in labels if not _LABEL.fullmatch(label)]
    if bad:
        raise ValueError(
            f"label {bad[0][:63]!r} is not 1 to 63 letters, digits and '-' (neither first nor last)"
        )
    if _NUMBER.fullmatch(labels[-1]):  # 2130706433, 127.1, 0x7f.1: resolvers read numbers
        raise ValueError("it ends in a number, which resolvers read as an IP address")
    return name


def _pattern(host: Any, field: str) -> str:
    if not isinstance(host, str) or not host:
        raise InvalidSession("a host name, or '*.' and a domain, is required", field=field)
    wildcard = host.startswith("*.")
    try:
        name = normalize_host(host[2:] if wildcard else host)
    except ValueError as exc:
        raise InvalidSession(f"{host[:HOST_MAX]!r}: {exc}", field=field) from None
    if wildcard and "." not in name:
        raise InvalidSession(
            f"{host!r} is too broad: a wildcard needs a domain of two labels or more "
            "(*.example.com)",
            field=field,
        )
    return f"*.{name}" if wildcard else name


# ---- rules -------------------------------------------------------------------------------


def parse_rules(raw: Any, field: str = "spec.network.allow") -> tuple[Rule, ...]:
    """The rules of a spec's allow list; InvalidSession names the first bad field."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise InvalidSession("a list of destinations is required", field=field)
    if len(raw) > RULES_MAX:
        raise InvalidSession(f"at most {RULES_MAX} destinations", field=field)
    return tuple(_rule(item, i, f"{field}[{i}]") for i, item in enumerate(raw))


def _rule(item: Any, i: int, field: str) -> Rule:
    if not isinstance(item, Mapping):
        raise InvalidSession("a destination is an object with a host", field=field)
    unknown = set(item) - {"host", "ports", "methods", "paths", "addresses", "inject"}
    if unknown:
        raise InvalidSession(f"unknown field {sorted(unknown)[0]!r}", field=field)
    return Rule(
        number=i + 1,
        host=_pattern(item.get("host"), f"{field}.host"),
        ports=_ports(item.get("ports"), f"{field}.ports"),
        methods=_methods(item.get("methods"), f"{field}.methods"),
        paths=_paths(item.get("paths"), f"{field}.paths"),
        addresses=_addresses(item.get("addresses"), f"{field}.addresses"),
        inject=_injections(item.get("inject"), f"{field}.inject"),
    )


def _injections(raw: Any, field: str) -> tuple[Injection, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw or len(raw) > INJECT_MAX:
        raise InvalidSession(f"a list of 1 to {INJECT_MAX} values to add is required", field=field)
    return tuple(_injection(item, f"{field}[{i}]") for i, item in enumerate(raw))


def _injection(item: Any, field: str) -> Injection:
    if not isinstance(item, Mapping):
        raise InvalidSession("an object: header, query or basicAuth, and secretKeyRef", field=field)
    unknown = set(item) - {"header", "query", "basicAuth", "prefix", "secretKeyRef"}
    kinds = [k for k in ("header", "query", "basicAuth") if k in item]
    if unknown or len(kinds) != 1:
        what = f"unknown field {sorted(unknown)[0]!r}" if unknown else "exactly one of"
        raise InvalidSession(f"{what}: header, query or basicAuth", field=field)
    kind = kinds[0]
    name = item[kind]
    pattern = {"header": _HEADER, "query": _QUERY, "basicAuth": _USER}[kind]
    if not isinstance(name, str) or not pattern.fullmatch(name):
        raise InvalidSession(f"{str(name)[:64]!r} is not a {_WHAT[kind]}", field=f"{field}.{kind}")
    if kind == "header" and name.lower() in _HEADERS_KEPT:
        raise InvalidSession(
            f"{name!r} is the proxy's to set, not a secret's", field=f"{field}.{kind}"
        )
    prefix = item.get("prefix", "")
    if prefix and kind != "header":
        raise InvalidSession("a prefix goes with a header only", field=f"{field}.prefix")
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise InvalidSession("up to 64 printable ASCII characters", field=f"{field}.prefix")
    ref = item.get("secretKeyRef")
    if not isinstance(ref, Mapping) or set(ref) != {"name", "key"}:
        raise InvalidSession("a Secret's name and key", field=f"{field}.secretKeyRef")
    secret, key = ref["name"], ref["key"]
    if not all(isinstance(v, str) and _SECRET_NAME.fullmatch(v) for v in (secret, key)):
        raise InvalidSession(
            "a Secret's name and a key (letters, digits, '-', '_' and '.')",
            field=f"{field}.secretKeyRef",
        )
    return Injection(kind, name, secret, key, prefix)


def permitted(asked: Sequence[Rule], offered: Sequence[Rule], field: str = "allow") -> list[Rule]:
    """A client's rules, within what the gateway offers clients: each host covered by an
    offered rule's host (the same name, or a name or narrower wildcard under an offered
    wildcard) on ports that rule has. A client names no address range and no Secret:
    those are the operator's (the offered rule's ranges go with it: the covering rules
    are returned, in order). InvalidSession names the first rule that is not."""
    covering = []
    for rule in asked:
        where = f"{field}[{rule.number - 1}]"
        if rule.addresses or rule.inject:
            what = "addresses" if rule.addresses else "inject"
            raise InvalidSession(f"{what} is the operator's to set, not a client's", field=where)
        found = next((o for o in offered if _covers(o, rule)), None)
        if found is None:
            hosts = ", ".join(o.host for o in offered) or "none"
            raise InvalidSession(
                f"{rule.host} on ports {', '.join(map(str, rule.ports))} is not among the "
                f"destinations this gateway lets clients choose ({hosts})",
                field=f"{where}.host",
            )
        covering.append(found)
    return covering


def _covers(offered: Rule, asked: Rule) -> bool:
    """Does `offered` allow all that `asked` would? Names, ports, methods and paths."""
    if not set(asked.ports) <= set(offered.ports):
        return False
    if offered.methods and not (asked.methods and set(asked.methods) <= set(offered.methods)):
        return False
    if offered.paths and not (
        asked.paths and all(any(_under(p, o) for o in offered.paths) for p in asked.paths)
    ):
        return False
    if offered.host.startswith("*."):
        return asked.host.endswith(offered.host[1:])  # a name or a wildcard under it
    return asked.host == offered.host


def injections(rules: Sequence[Rule], host: str, port: int, method: str, path: str) -> Rule | None:
    """The rule whose values are added to this request: the first that allows it and has
    values to add (None: nothing is added)."""
    name = normalize_host(host)
    for rule in rules:
        if rule.inject and rule.matches(name, port) and _refuses(rule, method, path) is None:
            return rule
    return None


def _ports(raw: Any, field: str) -> tuple[int, ...]:
    if raw is None:
        return DEFAULT_PORTS
    if not isinstance(raw, list) or not raw:
        raise InvalidSession("a non-empty list of ports is required", field=field)
    for p in raw:
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 65535:
            raise InvalidSession(f"{p!r} is not a port (1 to 65535)", field=field)
    return tuple(sorted(set(raw)))


def _methods(raw: Any, field: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise InvalidSession("a non-empty list of HTTP methods is required", field=field)
    for m in raw:
        if m not in METHODS:
            raise InvalidSession(f"{m!r} is not one of {', '.join(METHODS)}", field=field)
    return tuple(sorted(set(raw)))


def _paths(raw: Any, field: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw or len(raw) > PATHS_MAX:
        raise InvalidSession(f"a list of 1 to {PATHS_MAX} path prefixes is required", field=field)
    for p in raw:
        if not isinstance(p, str) or not p.startswith("/") or len(p) > PATH_MAX:
            raise InvalidSession(f"{p!r} is not a path prefix starting with '/'", field=field)
        if canonical_path(p) != p:
            raise InvalidSession(
                f"{p!r}: a prefix is a plain path: ASCII, no '.' or '..' segment, and no "
                "'%', '\\', ';', '?', '#', space or control character",
                field=field,
            )
    return tuple(raw)


def canonical_path(target: str) -> str | None:
    """The path of a request target (its query cut off) decoded once, if it is plain:
    None if what is left could be read another way by a server (see _UNCLEAR), so that
    a prefix check on it is the server's view. The proxy forwards this form."""
    path = target.split("?", 1)[0]
    if not path.startswith("/") or not path.isascii():
        return None
    try:
        decoded = urllib.parse.unquote(path, encoding="ascii", errors="strict")
    except UnicodeDecodeError:
        return None
    if _UNCLEAR.search(decoded) or _DOT_SEGMENT.search(decoded):
        return None
    return decoded


def _addresses(raw: Any, field: str) -> tuple[Network, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw or len(raw) > ADDRESSES_MAX:
        raise InvalidSession(
            f"a list of 1 to {ADDRESSES_MAX} address ranges is required", field=field
        )
    nets = []
    for r in raw:
        try:
            net = ipaddress.ip_network(r, strict=True)
        except (TypeError, ValueError) as exc:
            raise InvalidSession(f"{r!r} is not an address range ({exc})", field=field) from None
        never = next((n for n in _NEVER if n.version == net.version and net.overlaps(n)), None)
        if never is not None:
            raise InvalidSession(
                f"{r!r} overlaps {never}, which no rule may open (loopback, link-local and "
                "so the metadata address, unspecified, IPv4 carried in IPv6)",
                field=field,
            )
        nets.append(net)
    return tuple(nets)


# ---- verdicts ----------------------------------------------------------------------------


def check_connect(rules: Sequence[Rule], host: str, port: int) -> Verdict:
    """May a tunnel (CONNECT host:port) be opened? `inspect` when only rules about
    requests allow it: the proxy must read them, or refuse."""
    try:
        name = normalize_host(host)
    except ValueError as exc:
        return Verdict(False, f"refused: {host[:HOST_MAX]!r}: {exc}")
    matching = [r for r in rules if r.matches(name, port)]
    if not matching:
        return Verdict(False, f"refused: no rule allows {name} on port {port}")
    adds = next((r for r in matching if r.inject), None)
    if adds is not None:  # read, to add its values, even where another rule would not
        return Verdict(True, f"allowed by {adds.label()}, which adds values", adds, True)
    whole = next((r for r in matching if not r.reads_requests), None)
    if whole is not None:
        return Verdict(True, f"allowed by {whole.label()}", whole)
    first = matching[0]
    return Verdict(True, f"allowed by {first.label()} if its requests are read", first, True)


def check_request(rules: Sequence[Rule], host: str, port: int, method: str, path: str) -> Verdict:
    """May a request the proxy reads (plain HTTP, or inside a tunnel it terminates) go?"""
    tunnel = check_connect(rules, host, port)
    if not tunnel.allowed:
        return tunnel
    name = normalize_host(host)
    refusals = []
    for rule in (r for r in rules if r.matches(name, port)):
        why = _refuses(rule, method, path)
        if why is None:
            return Verdict(True, f"allowed by {rule.label()}", rule)
        refusals.append(f"{rule.label()}: {why}")
    return Verdict(False, "refused: " + "; ".join(refusals))


def _refuses(rule: Rule, method: str, target: str) -> str | None:
    if rule.methods and method not in rule.methods:
        return f"method {method} is not one of {', '.join(rule.methods)}"
    if not rule.paths:
        return None
    path = canonical_path(target)
    if path is None:
        return (
            f"path {target[:200]!r} is not a plain path (dot segments, encoded or unusual "
            "characters)"
        )
    if any(_under(path, prefix) for prefix in rule.paths):
        return None
    return f"path {path[:200]!r} is under none of {', '.join(rule.paths)}"


def _under(path: str, prefix: str) -> bool:
    if prefix.endswith("/"):
        return path.startswith(prefix)
    return path == prefix or path.startswith(prefix + "/")


def check_sni(host: str, sni: str | None) -> Verdict:
    """Do a tunnel's CONNECT host and its TLS SNI agree? A ClientHello without SNI goes to
    the address the proxy resolved for the host, so it is let through."""
    if sni is None:
        return Verdict(True, "no SNI: the tunnel goes to the CONNECT host's address")
    try:
        agree = normalize_host(sni) == normalize_host(host)
    except ValueError as exc:
        return Verdict(False, f"refused: the TLS server name {sni[:HOST_MAX]!r}: {exc}")
    if agree:
        return Verdict(True, "the TLS server name is the CONNECT host")
    return Verdict(False, f"refused: the TLS server name {sni[:253]!r} is not {host[:253]!r}")


def check_address(
    address: str | Address,
    rule: Rule | None = None,
    cluster: Iterable[Network] = (),
) -> Verdict:
    """May the proxy dial `address`, which a name allowed by `rule` resolved to?"""
    try:
        ip = _embedded(ipaddress.ip_address(address) if isinstance(address, str) else address)
    except ValueError:
        return Verdict(False, f"refused: {str(address)[:64]!r} is not an address")
    if ip is None:
        return Verdict(False, f"refused: {address} carries an IPv4 address in a form we refuse")
    listed = rule.addresses if rule is not None else ()
    if any(ip in net for net in listed):
        return Verdict(True, f"{ip} is in a range {rule.label() if rule else ''} lists", rule)
    inside = next((net for net in cluster if ip in net), None)
    if inside is not None:
        return Verdict(False, f"refused: {ip} is in the cluster's own range {inside}")
    if not _public(ip):
        return Verdict(False, f"refused: {ip} is {_kind(ip)}, not a public address")
    return Verdict(True, f"{ip} is a public address")


def _public(ip: Address) -> bool:
    """Our own rule, the same on every Python: global unicast, and none of the special
    blocks (ipaddress's is_global differs between versions and misses some)."""
    if not ip.is_global or ip.is_multicast:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip not in _GLOBAL_UNICAST:
        return False
    return not any(ip in net for net in _SPECIAL if net.version == ip.version)


def _embedded(ip: Address) -> Address | None:
    """The IPv4 address an IPv6 address carries to be reached (mapped, NAT64, 6to4,
    Teredo's client), judged in its place: 64:ff9b::a00:1 reaches 10.0.0.1 through a
    NAT64 gateway. None for the forms that are refused whatever they carry (IPv4-
    compatible, SIIT, local-use NAT64)."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return ip
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.is_loopback or ip.is_unspecified:  # ::1 and :: are judged as themselves
        return ip
    if any(ip in net for net in _REFUSED_V6):
        return None
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    return ip


def _kind(ip: Address) -> str:
    for test, words in (
        ("is_loopback", "a loopback address"),
        ("is_link_local", "a link-local address (the cloud metadata address is one)"),
        ("is_multicast", "a multicast address"),
        ("is_unspecified", "the unspecified address"),
        ("is_reserved", "a reserved address"),
        ("is_private", "a private address"),
    ):
        if getattr(ip, test):
            return words
    return "a reserved address"
