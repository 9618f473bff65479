"""A cluster session's keys besides its HMAC key: the Curve pair of its Jupyter channels and
the certificate of its code-mode bridge.

The operator makes both once per session and keeps them in the session's Secret, in the
connection file (`connection.json`) the kernel reads; the gateway reads them from the
Secret. They never appear in status or logs (the reprs leave out what is secret).

* **Curve** (CurveZMQ): ipykernel binds its five channels as Curve servers with the pair
  (`curve_publickey` / `curve_secretkey`, Z85), so everything on them is encrypted, and a
  client completes a handshake only if it knows the public key, which is kept in the Secret
  like the HMAC key, not published.
* **The bridge certificate**: a self-signed certificate and its EC P-256 key. The kernel's
  bridge listener and the gateway speak TLS 1.3 with it, each presenting it and accepting
  no other (mutual TLS pinned to the session's own certificate).

A Secret from an older operator has neither: the gateway then talks to that kernel as it
did (plaintext channels, a plain bridge) until the operator adds them, which it does
before it makes the session's next kernel pod. One that has them malformed is refused
here by name (KernelProtocolError), never half used.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils import z85

from mcp_forge.errors import KernelProtocolError
from mcp_forge.kernelside.framing import BRIDGE_CERT as BRIDGE_CERT
from mcp_forge.kernelside.framing import BRIDGE_KEY as BRIDGE_KEY

CURVE_PUBLIC = "curve_publickey"  # the names ipykernel and jupyter-client read
CURVE_SECRET = "curve_secretkey"
# BRIDGE_CERT and BRIDGE_KEY (ours: PEM; ipykernel ignores fields it does not know) are
# defined in kernelside/framing.py, where the kernel's listener that reads them finds them.
CURVE_TEXT = 40  # Z85 characters of a 32-byte Curve25519 key
PEM_MAX = 16_384  # a P-256 certificate or key is under 1 KB of PEM
CERT_DAYS = 3650  # the certificate is pinned, not chained: its dates matter little


@dataclass(frozen=True)
class CurveKeys:
    """A Curve pair, Z85 text as the connection file spells it. The public key is kept
    like the secret one: a client that lacks it completes no handshake."""

    public: str = field(repr=False)
    secret: str = field(repr=False)


def new_curve_keys() -> CurveKeys:
    public, secret = zmq.curve_keypair()
    return CurveKeys(public.decode("ascii"), secret.decode("ascii"))


def _curve_key(value: Any, name: str, where: str) -> bytes:
    if not isinstance(value, str) or len(value) != CURVE_TEXT:
        size = len(value) if isinstance(value, str) else type(value).__name__
        raise KernelProtocolError(
            f"{where}: {name} is not a Curve key ({CURVE_TEXT} Z85 characters; got {size})"
        )
    try:
        z85.decode(value.encode("ascii"))
    except (KeyError, ValueError, UnicodeEncodeError):
        raise KernelProtocolError(
            f"{where}: {name} is not a Curve key (characters outside Z85)"
        ) from None
    return value.encode("ascii")


def check_curve(keys: CurveKeys, where: str) -> None:
    """Refuse a pair that is not one: bad Z85, or a public key not the secret key's."""
    public = _curve_key(keys.public, CURVE_PUBLIC, where)
    secret = _curve_key(keys.secret, CURVE_SECRET, where)
    try:
        derived = zmq.curve_public(secret)
    except zmq.ZMQError:
        raise KernelProtocolError(f"{where}: {CURVE_SECRET} is not a Curve secret key") from None
    if derived != public:
        raise KernelProtocolError(
            f"{where}: {CURVE_PUBLIC} is not the public key of {CURVE_SECRET}"
        )


@dataclass(frozen=True)
class BridgeCert:
    """The bridge's certificate and private key, PEM text."""

    cert: str = field(repr=False)
    key: str = field(repr=False)

    @property
    def der(self) -> bytes:
        """The certificate as each side sees its peer's (what is pinned)."""
        return ssl.PEM_cert_to_DER_cert(self.cert)


def new_bridge_cert(name: str) -> BridgeCert:
    """A self-signed certificate for one session's bridge (`name` goes in its subject)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"mcp-forge bridge {name}"[:64])])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))  # nodes whose clocks lag
        .not_valid_after(now + dt.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("kernel")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _pem(cert, key)


def check_bridge_cert(bridge: BridgeCert, where: str) -> None:
    """Refuse a certificate or key that does not load, or a key that is not its own."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    for name, text in ((BRIDGE_CERT, bridge.cert), (BRIDGE_KEY, bridge.key)):
        if not isinstance(text, str) or not 0 < len(text) <= PEM_MAX:
            raise KernelProtocolError(f"{where}: {name} is not PEM text of at most {PEM_MAX} bytes")
    try:
        cert = x509.load_pem_x509_certificate(bridge.cert.encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        raise KernelProtocolError(f"{where}: {BRIDGE_CERT} is not a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(bridge.key.encode("ascii"), password=None)
    except (ValueError, TypeError, UnicodeEncodeError):
        raise KernelProtocolError(f"{where}: {BRIDGE_KEY} is not a PEM private key") from None
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if cert.public_key().public_bytes(*fmt) != key.public_key().public_bytes(*fmt):
        raise KernelProtocolError(f"{where}: {BRIDGE_KEY} is not the key of {BRIDGE_CERT}")


def _curve_in(info: Mapping[str, Any], where: str) -> CurveKeys | None:
    if CURVE_PUBLIC not in info and CURVE_SECRET not in info:
        return None
    for name in (CURVE_PUBLIC, CURVE_SECRET):
        if name not in info:
            raise KernelProtocolError(f"{where}: has a Curve key but no {name}")
    curve = CurveKeys(info[CURVE_PUBLIC], info[CURVE_SECRET])
    check_curve(curve, where)
    return curve


def _bridge_in(info: Mapping[str, Any], where: str) -> BridgeCert | None:
    if BRIDGE_CERT not in info and BRIDGE_KEY not in info:
        return None
    for name in (BRIDGE_CERT, BRIDGE_KEY):
        if name not in info:
            raise KernelProtocolError(f"{where}: has a bridge certificate but no {name}")
    bridge = BridgeCert(info[BRIDGE_CERT], info[BRIDGE_KEY])
    check_bridge_cert(bridge, where)
    return bridge


def keys_of(info: Mapping[str, Any], where: str) -> tuple[CurveKeys | None, BridgeCert | None]:
    """The Curve pair and the bridge certificate in a connection file, None where absent.

    KernelProtocolError, naming `where` and the field, for one that is present but
    malformed, or half present (a public key without its secret key).
    """
    return _curve_in(info, where), _bridge_in(info, where)


def usable_keys(info: Mapping[str, Any]) -> tuple[CurveKeys | None, BridgeCert | None]:
    """What keys_of finds, with a malformed one as None (the operator makes it anew)."""
    curve: CurveKeys | None = None
    bridge: BridgeCert | None = None
    with contextlib.suppress(KernelProtocolError):
        curve = _curve_in(info, "")
    with contextlib.suppress(KernelProtocolError):
        bridge = _bridge_in(info, "")
    return curve, bridge


@functools.lru_cache(maxsize=256)
def bridge_client_context(bridge: BridgeCert) -> ssl.SSLContext:
    """The gateway's TLS context for a session's bridge: TLS 1.3, presenting the session's
    certificate and trusting only it (callers also compare the peer's with `der`)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # one certificate per session, pinned: no names to check
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=bridge.cert)
    # ssl loads a key from a file only: an anonymous one in memory, gone when closed.
    fd = os.memfd_create("mcp-forge-bridge", os.MFD_CLOEXEC)
    try:
        os.write(fd, (bridge.cert + "\n" + bridge.key).encode("ascii"))
        context.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    return context


def new_egress_ca(name: str) -> BridgeCert:
    """A session's egress CA (issue 28): the proxy signs with it the certificates it shows
    the kernel for destinations it adds secrets to; the kernel trusts its certificate and
    never holds its key. A CA for leaves only (path length 0), EC P-256."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"mcp-forge egress {name}"[:64])])
    now = dt.datetime.now(dt.UTC)
    usage = x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
        encipher_only=False, decipher_only=False,
    )  # fmt: skip
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _pem(cert, key)


def _pem(cert: Any, key: Any) -> BridgeCert:
    """A certificate and its private key (PKCS#8, unencrypted), as PEM text."""
    from cryptography.hazmat.primitives import serialization

    return BridgeCert(
        cert.public_bytes(serialization.Encoding.PEM).decode("ascii"),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode("ascii"),
    )
