"""A cluster session's Curve pair and bridge certificate: made, rendered, read back, refused."""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from typing import Any, cast

import pytest
import zmq

from mcp_forge.api import kernelsession
from mcp_forge.api.connection import ConnectionInfo, connection_from_file, new_key
from mcp_forge.api.keys import (
    BRIDGE_CERT,
    BRIDGE_KEY,
    CURVE_PUBLIC,
    CURVE_SECRET,
    CurveKeys,
    bridge_client_context,
    keys_of,
    new_bridge_cert,
    new_curve_keys,
    usable_keys,
)
from mcp_forge.clients.kube import connection_file_of, key_of
from mcp_forge.control.render import render_kubernetes
from mcp_forge.errors import KernelProtocolError

WHERE = "Secret ns/ks-demo-conn"
CURVE = new_curve_keys()
CERT = new_bridge_cert("ns/demo")
INFO = ConnectionInfo("tcp", "ks-demo.ns.svc", new_key(), CURVE, CERT)


def session() -> kernelsession.KernelSession:
    body = {
        "apiVersion": kernelsession.API_VERSION,
        "kind": kernelsession.KIND,
        "metadata": {"name": "demo", "namespace": "ns"},
        "spec": {},
    }
    return kernelsession.load(kernelsession.validate(body))


def secret_file(info: ConnectionInfo) -> dict[str, Any]:
    (secret,) = [o for o in render_kubernetes(session(), info) if o["kind"] == "Secret"]
    loaded: dict[str, Any] = json.loads(secret["stringData"]["connection.json"])
    return loaded


def test_the_secret_holds_the_curve_pair_and_the_bridge_certificate_for_the_kernel() -> None:
    data = secret_file(INFO)
    assert data[CURVE_PUBLIC] == CURVE.public and data[CURVE_SECRET] == CURVE.secret
    assert data[BRIDGE_CERT].startswith("-----BEGIN CERTIFICATE-----")
    assert data[BRIDGE_KEY].startswith("-----BEGIN PRIVATE KEY-----")
    assert data["ip"] == "0.0.0.0" and data["transport"] == "tcp"
    # ipykernel reads the pair as Z85 text, and it is one.
    assert zmq.curve_public(data[CURVE_SECRET].encode()) == data[CURVE_PUBLIC].encode()


def test_keys_never_show_in_status_or_reprs() -> None:
    shown = json.dumps(INFO.public()) + repr(INFO) + repr(CURVE) + repr(CERT)
    for secret in (INFO.key, CURVE.secret, CURVE.public, CERT.key):
        assert secret not in shown


def test_every_session_gets_keys_of_its_own() -> None:
    assert new_curve_keys() != new_curve_keys()
    a, b = new_bridge_cert("ns/a"), new_bridge_cert("ns/b")
    assert a.cert != b.cert and a.key != b.key


def test_the_gateway_reads_back_what_the_operator_wrote() -> None:
    got = connection_from_file(secret_file(INFO), "10.0.0.7", WHERE)
    assert got == replace(INFO, host="10.0.0.7")


def test_a_secret_from_an_older_operator_is_read_as_plaintext_channels_and_bridge() -> None:
    old = secret_file(ConnectionInfo("tcp", "h", INFO.key))
    assert CURVE_PUBLIC not in old and BRIDGE_CERT not in old
    got = connection_from_file(old, "10.0.0.7", WHERE)
    assert got.curve is None and got.bridge is None and got.key == INFO.key
    assert usable_keys(old) == (None, None)


def _with(**fields: Any) -> dict[str, Any]:
    data = secret_file(INFO)
    for name, value in fields.items():
        if value is None:
            del data[name]
        else:
            data[name] = value
    return data


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({CURVE_SECRET: "x" * 39}, "curve_secretkey is not a Curve key (40 Z85 characters"),
        ({CURVE_SECRET: '"' * 40}, "curve_secretkey is not a Curve key (characters outside Z85)"),
        ({CURVE_PUBLIC: 12}, "curve_publickey is not a Curve key"),
        ({CURVE_PUBLIC: new_curve_keys().public}, "curve_publickey is not the public key of"),
        ({CURVE_SECRET: None}, "has a Curve key but no curve_secretkey"),
        ({BRIDGE_KEY: None}, "has a bridge certificate but no mcp_forge_bridge_key"),
        ({BRIDGE_CERT: "-----BEGIN CERTIFICATE-----\nnope\n"}, "mcp_forge_bridge_cert is not a"),
        ({BRIDGE_KEY: "garbage"}, "mcp_forge_bridge_key is not a PEM private key"),
        ({BRIDGE_KEY: new_bridge_cert("x").key}, "mcp_forge_bridge_key is not the key of"),
        ({BRIDGE_CERT: "A" * 100_000}, "mcp_forge_bridge_cert is not PEM text of at most"),
    ],
)
def test_a_malformed_key_is_refused_naming_the_secret_and_the_field(
    fields: dict[str, Any], named: str
) -> None:
    with pytest.raises(KernelProtocolError) as refused:
        connection_from_file(_with(**fields), "h", WHERE)
    assert str(refused.value).startswith(f"{WHERE}: "), refused.value
    assert named in str(refused.value)
    # The operator makes a malformed one anew (at the next pod), keeping the good one.
    curve, bridge = usable_keys(_with(**fields))
    if any(name.startswith("curve") for name in fields):
        assert curve is None and bridge == CERT
    else:
        assert bridge is None and curve == CURVE


def test_a_short_or_missing_hmac_key_is_refused_naming_the_secret() -> None:
    with pytest.raises(KernelProtocolError, match=f"^{WHERE}: .*at least 32"):
        connection_from_file(_with(key="short"), "h", WHERE)
    with pytest.raises(KernelProtocolError, match="has no key"):
        connection_from_file(_with(key=None), "h", WHERE)


def test_the_secret_is_read_from_data_or_string_data() -> None:
    text = json.dumps(secret_file(INFO))
    as_data = {"data": {"connection.json": base64.b64encode(text.encode()).decode()}}
    as_string = {"stringData": {"connection.json": text}}
    for secret in (as_data, as_string):
        assert keys_of(connection_file_of(secret) or {}, WHERE) == (CURVE, CERT)
        assert key_of(secret) == INFO.key
    assert connection_file_of({"stringData": {"connection.json": "[1]"}}) is None
    assert connection_file_of(None) is None


def test_the_gateways_tls_context_is_tls13_with_the_certificate_as_its_only_trust() -> None:
    context = bridge_client_context(CERT)
    assert context.minimum_version.name == "TLSv1_3"
    # ssl prints the serial in hex with any leading zero digits: compare numbers. (A str: the
    # typeshed value type is the union of every field's.)
    serials = [int(cast(str, c["serialNumber"]), 16) for c in context.get_ca_certs()]
    assert serials == [_serial(CERT.cert)]
    assert bridge_client_context(CERT) is context  # made once per certificate


def _serial(pem: str) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(pem.encode()).serial_number


def test_curve_keys_compare_by_value_only() -> None:
    assert CurveKeys(CURVE.public, CURVE.secret) == CURVE
