"""The egress tests' stand-ins for internet hosts (tests/egress_standins.py): the test CA,
this machine's own address, the HTTP(S) stand-in and the package index, used for real:
TLS clients that check the certificate for a test name, and pip."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import ipaddress
import json
import os
import re
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from egress_index import PackageIndex, build_wheel
from egress_standins import BYTES_MAX, DEFAULT_NAMES, StandIn, TestCA, own_address

pytestmark = pytest.mark.servers  # not the fast loop (docs/testing.md)

DEADLINE = 10.0  # seconds any single request or wait of a test may take


@pytest.fixture
def ca(tmp_path: Path) -> TestCA:
    return TestCA(tmp_path / "ca", addresses=[own_address()])


@pytest.fixture
def standin(ca: TestCA) -> Iterator[StandIn]:
    with StandIn(ca=ca) as server:
        yield server


def get(standin: StandIn, name: str, path: str) -> tuple[int, dict[str, str], bytes]:
    connection = standin.client(name, DEADLINE)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_own_address_is_an_ipv4_address_of_this_machine_other_than_loopback() -> None:
    address = ipaddress.IPv4Address(own_address())
    assert not address.is_loopback
    assert not address.is_link_local
    with socket.socket() as probe:
        probe.bind((str(address), 0))  # only an address of our own interfaces binds


def test_the_ca_writes_its_certificate_and_a_server_certificate_for_every_name(
    ca: TestCA,
) -> None:
    assert ca.ca_path.name == "ca.pem"
    assert stat.S_IMODE(ca.key_path.stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(ca.cert_path.read_bytes())
    issuer = x509.load_pem_x509_certificate(ca.ca_path.read_bytes())
    cert.verify_directly_issued_by(issuer)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert tuple(sans.get_values_for_type(x509.DNSName)) == DEFAULT_NAMES
    assert [str(a) for a in sans.get_values_for_type(x509.IPAddress)] == [own_address()]
    constraints = issuer.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca


def test_a_client_checking_the_certificate_for_a_test_name_connects_to_our_address(
    standin: StandIn, ca: TestCA
) -> None:
    names = ("api.test", "pypi.test", "deep.wild.test")
    for name in names:
        with socket.create_connection((standin.address, standin.port), DEADLINE) as raw:
            context = ssl.create_default_context(cafile=str(ca.ca_path))
            with context.wrap_socket(raw, server_hostname=name) as tls:
                tls.sendall(f"GET /echo HTTP/1.1\r\nHost: {name}\r\n\r\n".encode())
                assert tls.recv(64).startswith(b"HTTP/1.1 200 ")
    # each recorded before its answer was sent: nothing to wait for
    assert [(r.server_name, r.host, r.path) for r in standin.requests] == [
        (name, name, "/echo") for name in names
    ]


def test_a_name_the_certificate_does_not_hold_fails_the_clients_check(standin: StandIn) -> None:
    for name in ("evil.test", "wild.test", "a.b.wild.test"):
        with pytest.raises(ssl.SSLCertVerificationError):
            standin.client(name, DEADLINE)


def test_bytes_come_streamed_with_their_length_on_one_kept_alive_connection(
    standin: StandIn,
) -> None:
    connection = standin.client("files.test", DEADLINE)
    sock = connection.sock
    try:
        for n in (0, 1, 65537, 10_000_000):
            connection.request("GET", f"/bytes/{n}")
            response = connection.getresponse()
            body = response.read()
            assert (response.status, response.getheader("Content-Length")) == (200, str(n))
            assert len(body) == n
            assert body[:300] == (bytes(range(256)) * 2)[: min(n, 300)]
        connection.request("GET", f"/bytes/{BYTES_MAX + 1}")
        response = connection.getresponse()
        assert (response.status, response.read()) == (400, f"at most {BYTES_MAX} bytes\n".encode())
        assert connection.sock is sock  # not closed in between: the client would have dialled
    finally:
        connection.close()


def test_echo_answers_the_method_path_headers_and_body_length(standin: StandIn) -> None:
    connection = standin.client("api.test", DEADLINE)
    try:
        connection.putrequest("PUT", "/echo/v1/items?x=1")
        connection.putheader("X-Token", "one")
        connection.putheader("X-Token", "two")
        connection.putheader("Content-Length", "5")
        connection.endheaders(b"hello")
        response = connection.getresponse()
        put = json.loads(response.read())
        # a chunked body of an unknown length, as a proxy may forward one
        connection.request("POST", "/echo", body=iter([b"abc", b"", b"defg"]))
        posted = json.loads(connection.getresponse().read())
    finally:
        connection.close()
    assert (put["method"], put["path"], put["body_length"]) == ("PUT", "/echo/v1/items?x=1", 5)
    assert ["X-Token", "one"] in put["headers"]
    assert ["X-Token", "two"] in put["headers"]
    assert ["Host", f"api.test:{standin.port}"] in put["headers"]
    assert (posted["method"], posted["body_length"]) == ("POST", 7)
    assert ["Transfer-Encoding", "chunked"] in posted["headers"]


def test_every_request_is_recorded_even_those_answered_404(standin: StandIn) -> None:
    assert get(standin, "other.test", "/nothing/here")[0] == 404
    assert get(standin, "api.test", "/echo")[0] == 200
    assert [(r.method, r.host, r.path, r.server_name) for r in standin.requests] == [
        ("GET", f"other.test:{standin.port}", "/nothing/here", "other.test"),
        ("GET", f"api.test:{standin.port}", "/echo", "api.test"),
    ]
    assert ("Accept-Encoding", "identity") in standin.requests[0].headers


def test_wait_for_returns_a_request_made_from_another_thread(standin: StandIn) -> None:
    client = threading.Thread(target=get, args=(standin, "api.test", "/echo/late"))
    client.start()
    try:
        seen = standin.wait_for(lambda r: r.path == "/echo/late", DEADLINE)
    finally:
        client.join(DEADLINE)
    assert seen.host == f"api.test:{standin.port}"


def test_wait_for_says_what_did_arrive_when_nothing_matches(standin: StandIn) -> None:
    get(standin, "api.test", "/echo/first")
    with pytest.raises(TimeoutError, match=r"/echo/first"):
        standin.wait_for(lambda r: r.path == "/never", 0.05)


def test_a_plain_http_stand_in_serves_on_loopback_too() -> None:
    with StandIn("127.0.0.1") as standin:
        assert standin.url("api.test", "/echo") == f"http://api.test:{standin.port}/echo"
        url = f"http://127.0.0.1:{standin.port}/echo"
        with urllib.request.urlopen(url, data=b"xy", timeout=DEADLINE) as response:
            answer = json.loads(response.read())
        assert (answer["method"], answer["body_length"]) == ("POST", 2)
        assert standin.requests[0].server_name is None


def test_stop_ends_the_connections_kept_alive_and_returns(ca: TestCA) -> None:
    standin = StandIn(ca=ca)
    connection = standin.client("api.test", DEADLINE)
    try:
        connection.request("GET", "/echo")
        connection.getresponse().read()
        started = time.monotonic()
        standin.stop()
        assert time.monotonic() - started < DEADLINE / 2  # not the idle deadline's 30 s
        assert connection.sock.recv(1) == b""  # the server's end is gone
        standin.stop()  # again: nothing happens
    finally:
        connection.close()
        standin.stop()


def test_a_wheel_records_the_hash_and_size_of_each_of_its_files() -> None:
    wheel = build_wheel("Egress_Probe.Data")
    assert wheel.filename == "egress_probe_data-1.0-py3-none-any.whl"
    assert build_wheel("Egress_Probe.Data").data == wheel.data  # the same bytes each time
    with zipfile.ZipFile(io.BytesIO(wheel.data)) as archive:
        record = archive.read("egress_probe_data-1.0.dist-info/RECORD").decode()
        rows = [line.split(",") for line in record.splitlines()]
        assert {path for path, *_ in rows} == set(archive.namelist())
        for path, digest, size in rows:
            if path.endswith("RECORD"):
                assert (digest, size) == ("", "")
                continue
            data = archive.read(path)
            assert digest == "sha256=" + _urlsafe_sha256(data)
            assert int(size) == len(data)
        assert "Tag: py3-none-any" in archive.read("egress_probe_data-1.0.dist-info/WHEEL").decode()
        assert f"VALUE = {wheel.value!r}" in archive.read("egress_probe_data.py").decode()


def test_the_index_lists_its_projects_and_links_each_wheel_with_its_hash(ca: TestCA) -> None:
    with PackageIndex(["egress-probe", "Second.Project"], ca=ca) as index:
        status, headers, body = get(index, "pypi.test", "/simple/")
        assert (status, headers["Content-Type"]) == (200, "text/html")
        assert re.findall(r'href="([^"]+)"', body.decode()) == [
            "/simple/egress-probe/",
            "/simple/second-project/",
        ]
        status, _, body = get(index, "pypi.test", "/simple/egress-probe/")
        [href] = re.findall(r'href="([^"]+)"', body.decode())
        path, _, digest = href.partition("#sha256=")
        assert path == "/packages/egress_probe-1.0-py3-none-any.whl"
        status, headers, wheel = get(index, "pypi.test", path)
        assert (status, headers["Content-Type"]) == (200, "application/octet-stream")
        assert hashlib.sha256(wheel).hexdigest() == digest
        status, headers, _ = get(index, "pypi.test", "/simple/Second_Project")
        assert (status, headers["Location"]) == (301, "/simple/second-project/")
        assert get(index, "pypi.test", "/simple/absent/")[0] == 404
        assert get(index, "pypi.test", "/echo")[0] == 200  # still a stand-in


def test_pip_downloads_from_the_index_and_installs_a_wheel_whose_module_imports(
    tmp_path: Path, ca: TestCA
) -> None:
    # pip resolves the index's name itself, and /etc/hosts is not ours to edit: the
    # certificate also holds this machine's address, and pip is pointed at that.
    with PackageIndex(["Egress_Probe"], ca=ca) as index:
        pip(
            "download",
            "--no-deps",
            "--index-url",
            index.url(index.address, "/simple/"),
            "--cert",
            str(ca.ca_path),
            "-d",
            str(tmp_path / "downloads"),
            "egress-probe",
            home=tmp_path,
        )
        assert [r.path for r in index.requests] == [
            "/simple/egress-probe/",
            "/packages/egress_probe-1.0-py3-none-any.whl",
        ]
    [wheel] = (tmp_path / "downloads").iterdir()
    target = tmp_path / "target"
    pip("install", "--no-index", "--no-deps", "--target", str(target), str(wheel), home=tmp_path)
    spec = importlib.util.spec_from_file_location("egress_probe", target / "egress_probe.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert build_wheel("Egress_Probe").value == module.VALUE


def pip(*args: str, home: Path) -> None:
    """pip in this venv, told nothing by this machine's configuration: no pip.conf, no
    PIP_* variables, no proxies, and no REQUESTS_CA_BUNDLE (which pip's requests would
    prefer to --cert)."""
    env = {"PATH": os.defpath, "HOME": str(home), "LANG": "C.UTF-8"}
    argv = [sys.executable, "-m", "pip", *args[:1], "--isolated", "--no-cache-dir"]
    argv += ["--disable-pip-version-check", "--no-input", "--retries", "0", *args[1:]]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def _urlsafe_sha256(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
