"""A package index of the test's own, on loopback: the Simple Repository API's HTML pages
(PEP 503, with sha256 fragments) for wheels and sdists the test makes, a log of every
path asked for, and downloads that can be held until the test lets them go.

The distributions are real: wheels pip downloads and the kernel's pip installs, sdists
with an in-tree PEP 517 backend (no setuptools: the build sandbox has no network) that
records, in the wheel it builds, what it saw while it ran: its uid, its user namespace,
its network interfaces, its environment, whether a host file was visible.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def wheel_bytes(
    name: str, version: str, files: dict[str, str], requires: tuple[str, ...] = ()
) -> bytes:
    """A py3-none-any wheel of `files` (path -> text), with its dist-info."""
    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    entries = {
        **files,
        f"{dist}/METADATA": meta,
        f"{dist}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        lines = []
        for path, text in entries.items():
            z.writestr(path, text)
            lines.append(_record_line(path, text.encode()))
        lines.append(f"{dist}/RECORD,,")
        z.writestr(f"{dist}/RECORD", "\n".join(lines) + "\n")
    return buf.getvalue()


def sdist_bytes(
    name: str,
    version: str,
    *,
    requires: tuple[str, ...] = (),
    canary: str = "/nonexistent",
    marker: str = "/nonexistent/marker",
    imports: tuple[str, ...] = (),
) -> bytes:
    """An sdist with evidence_backend.py as its in-tree backend; `requires` its build requirements
    (the backend imports `imports` of them when it runs)."""
    top = f"{name.replace('-', '_')}-{version}"
    reqs = ", ".join(f'"{r}"' for r in requires)
    files = {
        "pyproject.toml": (
            f"[build-system]\nrequires = [{reqs}]\n"
            'build-backend = "backend"\nbackend-path = ["."]\n'
            f'[project]\nname = "{name}"\nversion = "{version}"\n'
        ),
        "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        "backend.py": _backend(name, version, canary, marker, imports),
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for path, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{path}")
            info.size = len(data)
            info.mode = 0o644
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _backend(name: str, version: str, canary: str, marker: str, imports: tuple[str, ...]) -> str:
    """evidence_backend.py's source, its settings replaced."""
    source = (Path(__file__).parent / "evidence_backend.py").read_text()
    names = "NAME, VERSION, CANARY, MARKER, IMPORTS = "
    default = names + '"x", "0", "/nonexistent", "/nonexistent/m", ("",)'
    assert default in source
    values = ", ".join(repr(v) for v in (name, version, canary, marker, imports))
    return source.replace(default, names + values)


class PackageIndex:
    """The index: `add` files, `url` for --index-url, `asked` the paths requested.
    Downloads of a project in `held` wait until `release` (or the server stops)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: dict[str, dict[str, bytes]] = {}  # project -> filename -> bytes
        self.asked: list[str] = []
        self.held: set[str] = set()
        self.waiting = threading.Semaphore(0)  # one release per held download that arrived
        self.arrived = 0
        self._go = threading.Event()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def add(self, name: str, filename: str, data: bytes) -> None:
        self.files.setdefault(canonicalize_name(name), {})[filename] = data

    def add_wheel(self, name: str, version: str, init: str) -> None:
        """A pure wheel whose package's __init__.py is `init`."""
        pkg = name.replace("-", "_")
        data = wheel_bytes(name, version, {f"{pkg}/__init__.py": init})
        self.add(name, f"{pkg}-{version}-py3-none-any.whl", data)

    def add_sdist(self, name: str, version: str, **options: Any) -> None:
        """An sdist built by the evidence backend (`sdist_bytes`'s options)."""
        data = sdist_bytes(name, version, **options)
        self.add(name, f"{name.replace('-', '_')}-{version}.tar.gz", data)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/simple/"

    def asked_for(self, project: str) -> bool:
        key = canonicalize_name(project)
        return any(f"/simple/{key}/" in p or f"/files/{key}/" in p for p in self.asked)

    def hold(self, project: str) -> None:
        """Hold `project`'s downloads from now on, until `release`."""
        self._go.clear()
        self.held.add(canonicalize_name(project))

    def release(self) -> None:
        self._go.set()
        self.held.clear()

    def _page(self, project: str) -> bytes | None:
        files = self.files.get(project)
        if files is None:
            return None
        links = "".join(
            f'<a href="/files/{project}/{html.escape(f)}#sha256={hashlib.sha256(d).hexdigest()}">'
            f"{html.escape(f)}</a><br/>\n"
            for f, d in files.items()
        )
        return f"<!DOCTYPE html><html><body>{links}</body></html>".encode()

    @contextmanager
    def serving(self) -> Iterator[PackageIndex]:
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                with index._lock:
                    index.asked.append(self.path)
                parts = self.path.split("?")[0].strip("/").split("/")
                body: bytes | None = None
                kind = "text/html"
                if len(parts) == 2 and parts[0] == "simple":
                    body = index._page(canonicalize_name(parts[1]))
                elif len(parts) == 3 and parts[0] == "files":
                    body = index.files.get(parts[1], {}).get(parts[2])
                    kind = "application/octet-stream"
                    if body is not None and parts[1] in index.held:
                        with index._lock:
                            index.arrived += 1
                        index.waiting.release()
                        index._go.wait(timeout=120)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "max-age=600")
                self.end_headers()
                self.wfile.write(body)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._server = server
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._go.set()
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)
