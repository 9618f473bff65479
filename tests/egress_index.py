"""A stand-in package index for the egress tests (issue 28): a StandIn (egress_standins.py)
that is also a PEP 503 simple index of pure-Python wheels built here, each with a module
whose VALUE names it.

tests/ is on sys.path: `from egress_index import PackageIndex`. `hosts_standing` is the
egress tests' stand-ins, both of them, on this machine's own address.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import html
import io
import re
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from egress_standins import Recorded, Reply, StandIn, TestCA, own_address


def normalize(project: str) -> str:
    """A project's name as PEP 503 spells it in URLs."""
    return re.sub(r"[-_.]+", "-", project).lower()


@dataclass(frozen=True)
class Wheel:
    """A pure-Python wheel built in memory: `module`.py defining VALUE = `value`."""

    project: str
    version: str
    module: str
    value: str
    filename: str
    data: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def build_wheel(project: str, version: str = "1.0") -> Wheel:
    """A py3-none-any wheel of `project` with one module (the name, underscored) defining
    VALUE, its METADATA, WHEEL and a RECORD of sha256 hashes; the same bytes every time."""
    module = normalize(project).replace("-", "_")
    value = f"{normalize(project)} {version} from the egress stand-in index"
    dist_info = f"{module}-{version}.dist-info"
    files = {
        f"{module}.py": f'"""Served by the egress stand-in index."""\n\nVALUE = {value!r}\n',
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n"
            "Summary: a package the egress stand-in index serves\n"
        ),
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: egress_standins\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n"
        ),
    }
    record = io.StringIO()
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.write(f"{path},sha256={digest.decode()},{len(text.encode())}\n")
    record.write(f"{dist_info}/RECORD,,\n")
    files[f"{dist_info}/RECORD"] = record.getvalue()

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as wheel:
        for path, text in files.items():
            info = zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(info, text)
    filename = f"{module}-{version}-py3-none-any.whl"
    return Wheel(project, version, module, value, filename, buffer.getvalue())


class PackageIndex(StandIn):
    """A StandIn that is also a PEP 503 simple index of `projects`, one wheel each
    (`build_wheel`): `/simple/` lists them, `/simple/<name>/` links to
    `/packages/<file>#sha256=<hex>`, `/packages/<file>` serves it. A project asked for by an
    unnormalized name is redirected to its normalized one."""

    def __init__(
        self, projects: Iterable[str], address: str | None = None, ca: TestCA | None = None
    ) -> None:
        self.wheels = {normalize(p): build_wheel(p) for p in projects}
        self._files = {w.filename: w for w in self.wheels.values()}
        super().__init__(address, ca)

    def reply(self, request: Recorded, body_length: int) -> Reply:
        path = request.path.split("?")[0]
        if path == "/simple/":
            links = "".join(
                f'<a href="/simple/{name}/">{html.escape(name)}</a>\n' for name in self.wheels
            )
            return _page("Simple index", links)
        if match := re.fullmatch(r"/simple/([^/]+)/?", path):
            name = normalize(match[1])
            wheel = self.wheels.get(name)
            if wheel is None:
                return Reply.of(404, b"no such project\n")
            if match[0] != f"/simple/{name}/":
                return _redirect(f"/simple/{name}/")
            link = (
                f'<a href="/packages/{wheel.filename}#sha256={wheel.sha256}">'
                f"{html.escape(wheel.filename)}</a>\n"
            )
            return _page(f"Links for {name}", link)
        if (match := re.fullmatch(r"/packages/([^/]+)", path)) and match[1] in self._files:
            return Reply.of(200, self._files[match[1]].data, "application/octet-stream")
        return super().reply(request, body_length)


def _page(title: str, body: str) -> Reply:
    text = (
        "<!DOCTYPE html>\n<html><head>"
        '<meta name="pypi:repository-version" content="1.0">'
        f"<title>{html.escape(title)}</title></head>\n<body>\n{body}</body></html>\n"
    )
    return Reply.of(200, text.encode(), "text/html")


def _redirect(location: str) -> Reply:
    return Reply(301, "text/plain", 0, (), headers=(("Location", location),))


@dataclass
class Hosts:
    """The stand-ins of an egress test: an HTTPS server and a package index."""

    address: str
    ca: TestCA
    https: StandIn
    index: PackageIndex


@contextlib.contextmanager
def hosts_standing(directory: Path, package: str) -> Iterator[Hosts]:
    """Both stand-ins on this machine's own address, certified by a test CA made in
    `directory`; the index serves `package`."""
    address = own_address()
    ca = TestCA(directory, addresses=(address,))
    with StandIn(address, ca) as https, PackageIndex([package], address, ca) as index:
        yield Hosts(address, ca, https, index)
