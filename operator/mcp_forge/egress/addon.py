"""The egress proxy's one addon: who is asking, may it go there, and to which address.

mitmproxy does the HTTP and TLS; this addon holds only the policy, at mitmproxy's hooks:

* `http_connect` (a tunnel) and `requestheaders` (a plain HTTP request, or one read inside
  a tunnel): the session is known by its credential (`Proxy-Authorization`), and, for a
  connection that came through its own socket, by that socket too (local mode); in
  cluster mode by its credential alone, found by its digest, and `admit` asked whether
  the connection may be the session's (its bound); either way a connection is bound to
  its session at its first request and speaks for no other after; the name is checked
  against the session's rules (`api/egress.py`), resolved here, once, and each address
  judged (no private, loopback, link-local or metadata address unless the rule lists
  it); the request is then pinned to the address judged, so a name that resolves
  otherwise a moment later (rebinding) changes nothing.
* `tls_clienthello`: a tunnel's TLS server name must be its CONNECT host. The tunnel is
  then passed through untouched (mitmproxy never reads it); a tunnel whose server name
  differs is refused (its handshake fails) and never dialled.
* `server_connect`: the last word. mitmproxy dials only an address this addon pinned for
  that client connection; anything else (a request inside a tunnel naming another Host)
  is killed before it connects.

A refusal is a 403 whose reason phrase and body say which rule, or which check, refused
it: pip and urllib print the reason phrase. Every verdict goes to `audit`, never with a
credential or a header's value.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, quote_plus

from mitmproxy import connection, ctx, http, tls
from mitmproxy.net.http import url

from mcp_forge.api import egress
from mcp_forge.egress.protocol import PLACEHOLDER, PROXY_USER

Audit = Callable[[dict[str, Any]], None]
# Cluster mode: may the connection from this port be this session's? None, or why not.
Admit = Callable[[int | None, str], str | None]
REASON_MAX = 200  # a reason phrase is one short line
_ADDED = "mcpforge_added"  # a flow's metadata: the values added to its request
_ECHOING = ("Location", "Content-Location", "Link", "Refresh")
RESOLVE_TIMEOUT = 5.0


@dataclass
class Session:
    name: str
    token: str
    rules: tuple[egress.Rule, ...]
    # For destinations the proxy reads: the session's CA (a mitmproxy CertStore), and the
    # values it adds, by (rule number, index). Never logged.
    certstore: Any = None
    values: dict[tuple[int, int], str] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Refused:
    """A credential that names a session the connection may not join (its bound)."""

    session: Session
    reason: str


@dataclass
class Tunnel:
    """What a client connection was allowed: for a CONNECT, its host and the address."""

    session: Session
    host: str = ""
    port: int = 0
    address: str = ""
    rule: egress.Rule | None = None
    refused: str | None = None  # a tunnel refused after its 200 (its TLS server name)
    intercept: bool = False  # read: TLS ended here with the session's CA
    pinned: set[tuple[str, int]] = field(default_factory=set)


class Policy:
    """The sessions' rules, and the verdicts at mitmproxy's hooks."""

    def __init__(
        self,
        audit: Audit,
        resolve_table: dict[str, list[str]] | None = None,
        cluster: Iterable[egress.Network] = (),
        relayed_only: bool = True,
        admit: Admit | None = None,
    ) -> None:
        self.audit = audit
        self.sessions: dict[str, Session] = {}  # by name
        # By the SHA-256 of their token: one lookup, no comparison with every session's.
        self.tokens: dict[bytes, str] = {}
        self.admit = admit
        self.relayed: dict[int, str] = {}  # a relayed connection's local port: its session
        # A client connection's session, fixed at its first request: the relay may have
        # let go of its port while mitmproxy still reads what it sent.
        self.bound: dict[str, str] = {}
        # Local mode: only connections through a session's socket speak for a session.
        self.relayed_only = relayed_only
        self.clients: dict[str, Tunnel] = {}  # by mitmproxy's client connection id
        self.resolve_table = resolve_table  # tests only: names to this machine's addresses
        self.cluster = tuple(cluster)

    # ---- sessions ------------------------------------------------------------------

    def add(self, session: Session) -> None:
        """A session (again: one of that name is replaced)."""
        self.remove(session.name)
        self.sessions[session.name] = session
        self.tokens[_digest(session.token)] = session.name

    def remove(self, name: str) -> None:
        session = self.sessions.pop(name, None)
        if session is not None and self.tokens.get(_digest(session.token)) == name:
            del self.tokens[_digest(session.token)]

    def holder(self, token: str) -> str | None:
        """The name of the session whose token this is, if any."""
        return self.tokens.get(_digest(token))

    # ---- who -----------------------------------------------------------------------

    def _credential(self, flow: http.HTTPFlow) -> str | None:
        raw = flow.request.headers.get("Proxy-Authorization", "")
        scheme, _, value = raw.partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            user, _, token = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return token if user == PROXY_USER else None

    def _session(self, flow: http.HTTPFlow) -> Session | Refused | None:
        token = self._credential(flow)
        if token is None:
            return None
        relayed = self.bound.get(flow.client_conn.id)
        if relayed is None:
            port = flow.client_conn.peername[1] if flow.client_conn.peername else None
            relayed = self.relayed.get(port) if port is not None else None
            if relayed is not None:
                self.bound[flow.client_conn.id] = relayed
        if relayed is not None:  # it came through a session's socket: that session only
            found = self.sessions.get(relayed)
            candidates = [found] if found is not None else []
        elif self.relayed_only:
            candidates = []
        else:
            return self._by_token(flow, token)
        for session in candidates:
            if _same(session.token, token):
                return session
        return None

    def _by_token(self, flow: http.HTTPFlow, token: str) -> Session | Refused | None:
        """Cluster mode: a connection's first credential, and the session it names, if
        the connection may join it. Bound to it from then on."""
        name = self.holder(token)
        session = self.sessions.get(name) if name is not None else None
        if session is None or not _same(session.token, token):
            return None
        if self.admit is not None:
            port = flow.client_conn.peername[1] if flow.client_conn.peername else None
            refusal = self.admit(port, session.name)
            if refusal is not None:
                return Refused(session, refusal)
        self.bound[flow.client_conn.id] = session.name
        return session

    # ---- hooks ---------------------------------------------------------------------

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        session = self._session(flow)
        if session is None:
            return self._unknown(flow)
        host, port = _asked(flow.request), flow.request.port
        if isinstance(session, Refused):
            return self._turned_away(flow, session, host, port)
        verdict = egress.check_connect(session.rules, host, port)
        if verdict.allowed and verdict.inspect and session.certstore is None:
            verdict = egress.Verdict(
                False,
                f"refused: {verdict.rule.label() if verdict.rule else 'the rule'} needs its "
                "requests read, and the session has no CA to read them with",
            )
        address = (
            await self._dial_address(session, host, port, verdict) if verdict.allowed else None
        )
        if address is None or isinstance(address, egress.Verdict):
            refusal = address if isinstance(address, egress.Verdict) else verdict
            return self._refuse(flow, session, "connect", host, port, refusal)
        tunnel = Tunnel(session, egress.normalize_host(host), port, address, verdict.rule)
        tunnel.intercept = verdict.inspect
        tunnel.pinned.add((address, port))
        self.clients[flow.client_conn.id] = tunnel
        flow.request.data.host = address  # mitmproxy dials what was judged, nothing else
        self._log(session, "connect", host, port, True, verdict.reason, address=address)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.request.method == "CONNECT" or flow.response is not None:
            return
        tunnel = self.clients.get(flow.client_conn.id)
        if tunnel is not None and tunnel.host:
            self._in_tunnel(flow, tunnel)
        else:
            await self._plain(flow)  # reads the credential first
        flow.request.headers.pop("Proxy-Authorization", None)  # never to the server

    def _in_tunnel(self, flow: http.HTTPFlow, tunnel: Tunnel) -> None:
        """A request mitmproxy read inside a tunnel (plain HTTP sent through CONNECT). Its
        Host header, and the authority of an absolute-form target (which a server reads
        before the Host header), must name the tunnel's host and port; one Host header
        only, since servers differ on which of two they read."""
        hosts = flow.request.headers.get_all("Host")
        named = [a for a in (flow.request.authority, *hosts) if a]
        other = next((a for a in named if not _names(a, tunnel.host, tunnel.port)), None)
        why: str | None = None
        if len(hosts) > 1:
            why = f"{len(hosts)} Host headers inside a tunnel to {tunnel.host}"
        elif other is not None:
            why = f"{other[:64]!r} inside a tunnel to {tunnel.host}"
        if why is not None:
            shown = named[-1] if named else tunnel.host
            verdict = egress.Verdict(False, f"refused: {why}")
            return self._refuse(flow, tunnel.session, "request", shown, tunnel.port, verdict)
        flow.request.authority = ""  # origin-form: the server reads the Host header alone
        flow.request.data.host = tunnel.address
        flow.request.data.port = tunnel.port
        if tunnel.intercept:
            self._read_request(flow, tunnel)
        return None

    def _read_request(self, flow: http.HTTPFlow, tunnel: Tunnel) -> None:
        """A request in a tunnel the proxy reads: held to its rules' methods and paths,
        then given the values its rule adds (replacing what the kernel sent)."""
        session, method, path = tunnel.session, flow.request.method, flow.request.path
        # Only rules under which the pinned address may be dialled speak for the request.
        rules = [
            r
            for r in session.rules
            if egress.check_address(tunnel.address, r, self.cluster).allowed
        ]
        verdict = egress.check_request(rules, tunnel.host, tunnel.port, method, path)
        if not verdict.allowed:
            return self._refuse(flow, session, "request", tunnel.host, tunnel.port, verdict)
        shown = {"method": method, "path": path[:200]}  # before a value joins the query
        rule = egress.injections(rules, tunnel.host, tunnel.port, method, path)
        if rule is not None and not flow.client_conn.tls_established:
            why = egress.Verdict(
                False, f"refused: {rule.label()} adds values, sent over TLS only (this is plain)"
            )
            return self._refuse(flow, session, "request", tunnel.host, tunnel.port, why)
        added_values = []
        for i, injection in enumerate(rule.inject if rule else ()):
            value = session.values.get((rule.number if rule else 0, i))
            if value is None:
                why = egress.Verdict(False, f"refused: no value for {injection.kind} {i + 1}")
                return self._refuse(flow, session, "request", tunnel.host, tunnel.port, why)
            _add(flow.request, injection, value)
            added_values.append(value)
        if added_values:
            flow.metadata[_ADDED] = added_values  # kept out of what the kernel reads back
        added = len(rule.inject) if rule else 0
        self._log(
            session, "request", tunnel.host, tunnel.port, True, verdict.reason,
            added=added, **shown,
        )  # fmt: skip
        return None

    async def _plain(self, flow: http.HTTPFlow) -> None:
        """A plain HTTP request through the proxy (`GET http://host/path`)."""
        session = self._session(flow)
        if session is None:
            return self._unknown(flow)
        host, port = _asked(flow.request), flow.request.port
        if isinstance(session, Refused):
            return self._turned_away(flow, session, host, port)
        verdict = egress.check_request(
            session.rules, host, port, flow.request.method, flow.request.path
        )
        address = (
            await self._dial_address(session, host, port, verdict) if verdict.allowed else None
        )
        if address is None or isinstance(address, egress.Verdict):
            refusal = address if isinstance(address, egress.Verdict) else verdict
            return self._refuse(flow, session, "request", host, port, refusal)
        tunnel = self.clients.setdefault(flow.client_conn.id, Tunnel(session))
        tunnel.pinned.add((address, port))
        # The Host the server reads is the name judged, whatever the client sent beside
        # it (a second Host header, another name or port: RFC 9112 3.2.2 has a proxy
        # replace it with the target's authority).
        flow.request.headers["Host"] = url.hostport("http", egress.normalize_host(host), port)
        flow.request.data.host = address
        self._log(session, "request", host, port, True, verdict.reason, method=flow.request.method)

    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        tunnel = self.clients.get(data.context.client.id)
        if tunnel is None or not tunnel.host:
            return  # not a tunnel of ours: mitmproxy's own handling (none here)
        verdict = egress.check_sni(tunnel.host, data.client_hello.sni)
        if verdict.allowed:
            data.ignore_connection = not tunnel.intercept  # else read: tls_start_client
            return
        tunnel.refused = verdict.reason
        self._log(tunnel.session, "tls", tunnel.host, tunnel.port, False, verdict.reason)

    def tls_start_client(self, data: tls.TlsData) -> None:
        tunnel = self.clients.get(data.context.client.id)
        if tunnel is not None and tunnel.refused is not None:
            from OpenSSL import SSL  # mitmproxy's own dependency

            # No certificate at all: the client's handshake fails, nothing is dialled.
            data.ssl_conn = SSL.Connection(SSL.Context(SSL.TLS_SERVER_METHOD))
            data.ssl_conn.set_accept_state()
        elif tunnel is not None and tunnel.intercept:
            # mitmproxy's own TLS set-up, with the session's CA for the certificate: the
            # hook is synchronous, so no other connection sees the store swapped.
            tlsconfig = ctx.master.addons.get("tlsconfig")
            kept = tlsconfig.certstore
            tlsconfig.certstore = tunnel.session.certstore
            try:
                tlsconfig.tls_start_client(data)
            finally:
                tlsconfig.certstore = kept

    def server_connect(self, data: Any) -> None:
        tunnel = self.clients.get(data.client.id)
        address = data.server.address
        if tunnel is None or address is None or (address[0], address[1]) not in tunnel.pinned:
            data.server.error = "the egress policy pinned no such address for this client"
            if tunnel is not None:
                self._log(tunnel.session, "dial", str(address), 0, False, data.server.error)
        elif tunnel.intercept:
            data.server.sni = tunnel.host  # the name the server's certificate must carry

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """A value added to a request does not come back in the headers that repeat its
        URL (a redirect keeping the query): it reads as a placeholder, which the proxy
        replaces again if the kernel follows it."""
        added = flow.metadata.get(_ADDED)
        if not added or flow.response is None:
            return
        forms = {f for v in added for f in (v, quote(v, safe=""), quote_plus(v))}
        for name in _ECHOING:
            values = flow.response.headers.get_all(name)
            clean = [_without(v, forms) for v in values]
            if clean != values:
                flow.response.headers.set_all(name, clean)

    def client_disconnected(self, client: connection.Client) -> None:
        self.clients.pop(client.id, None)
        self.bound.pop(client.id, None)

    # ---- names and addresses -------------------------------------------------------

    async def _dial_address(
        self, session: Session, host: str, port: int, verdict: egress.Verdict
    ) -> str | egress.Verdict:
        """The address to dial for an allowed name, or the verdict refusing it."""
        try:
            found = await self._resolve(egress.normalize_host(host), port)
        except (OSError, TimeoutError, ValueError) as exc:
            return egress.Verdict(False, f"refused: {host[:64]} did not resolve ({exc})")
        first: egress.Verdict | None = None
        for address in found:
            judged = egress.check_address(address, verdict.rule, self.cluster)
            if judged.allowed:
                return address
            first = first or judged
        return first or egress.Verdict(False, f"refused: {host[:64]} has no address")

    async def _resolve(self, name: str, port: int) -> list[str]:
        if self.resolve_table is not None and name in self.resolve_table:
            return list(self.resolve_table[name])
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(RESOLVE_TIMEOUT):
            infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
        return list(dict.fromkeys(str(info[4][0]) for info in infos))

    # ---- answers -------------------------------------------------------------------

    def _unknown(self, flow: http.HTTPFlow) -> None:
        flow.response = http.Response.make(
            407,
            b"egress proxy: no session with this credential\n",
            {"Proxy-Authenticate": 'Basic realm="mcp-forge egress"', "Content-Type": "text/plain"},
        )
        self.audit({"event": "unknown", "host": flow.request.host[:64]})

    def _turned_away(self, flow: http.HTTPFlow, refused: Refused, host: str, port: int) -> None:
        """A 403 naming the bound, and the connection closed after it (it joined no one)."""
        verdict = egress.Verdict(False, refused.reason)
        self._refuse(flow, refused.session, "limit", host, port, verdict)
        if flow.response is not None:
            flow.response.headers["Connection"] = "close"

    def _refuse(
        self,
        flow: http.HTTPFlow,
        session: Session,
        kind: str,
        host: str,
        port: int,
        verdict: egress.Verdict,
    ) -> None:
        phrase = _printable(f"Forbidden by egress rule: {verdict.reason}")
        body = f"egress proxy, session {session.name}: {verdict.reason}\n"
        flow.response = http.Response.make(
            403, body.encode(), {"Content-Type": "text/plain; charset=utf-8"}
        )
        flow.response.reason = phrase
        self._log(session, kind, host, port, False, verdict.reason)

    def _log(
        self,
        session: Session,
        kind: str,
        host: str,
        port: int,
        allowed: bool,
        reason: str,
        **extra: Any,
    ) -> None:
        self.audit(
            {
                "event": kind,
                "session": session.name,
                "host": host[:253],
                "port": port,
                "allowed": allowed,
                "reason": reason[:400],
                **extra,
            }
        )


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode(errors="surrogatepass")).digest()


def _same(ours: str, theirs: str) -> bool:
    """In constant time, as bytes: compare_digest refuses a str that is not ASCII (a
    client's password may be any UTF-8), and a TypeError in a hook is no answer."""
    return hmac.compare_digest(
        ours.encode(errors="surrogatepass"), theirs.encode(errors="surrogatepass")
    )


def _asked(request: http.Request) -> str:
    """The host a request names, in ASCII as rules are: mitmproxy hands over an A-label
    (xn--...) decoded into Unicode, which api/egress.py would refuse. Encoded back, the
    name judged is the name resolved and dialled (a name sent in Unicode never gets here
    from a request line: mitmproxy's parser refuses it)."""
    host = str(request.host)
    if host.isascii():
        return host
    try:
        return host.encode("idna").decode("ascii")
    except UnicodeError:
        return host  # refused as it is: not ASCII


def _names(authority: str, host: str, port: int) -> bool:
    """Whether `authority` (a Host header, or an absolute-form target's) names `host`
    (normalized) on `port` (a default port when it names none)."""
    name, named_port = url.parse_authority(authority, check=False)
    try:
        same = egress.normalize_host(name) == host
    except ValueError:
        return False
    return same and (named_port is None or named_port == port)


def _add(request: http.Request, injection: egress.Injection, value: str) -> None:
    """One value into a request, replacing any the kernel sent under that name."""
    if injection.kind == "header":
        request.headers[injection.name] = injection.prefix + value
    elif injection.kind == "query":
        request.query[injection.name] = value
    else:
        basic = base64.b64encode(f"{injection.name}:{value}".encode()).decode()
        request.headers["Authorization"] = f"Basic {basic}"


def _without(text: str, forms: set[str]) -> str:
    for form in forms:
        text = text.replace(form, PLACEHOLDER)
    return text


def _printable(text: str) -> str:
    """A reason phrase: printable ASCII on one line, bounded."""
    clean = "".join(c if " " <= c <= "~" else "?" for c in text)
    return clean[:REASON_MAX]
