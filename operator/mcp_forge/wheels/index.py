"""A requirement's source distribution, found and fetched from the package index without
pip: pip would prepare its metadata, which runs the package's code, on the host.

The index is the gateway's configured one, read as the Simple Repository API has it:
JSON (PEP 691) where the index speaks it, else the HTML page (PEP 503). Its answer is
bounded (PAGE_MAX), every file name is parsed as an sdist name, yanked files and files
for other Pythons are passed over, and the newest version the requirement allows is
taken. The download is bounded by the policy's file size and checked against the hash
the index gives; a file without a sha256 hash is refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import InvalidSdistFilename, canonicalize_name, parse_sdist_filename
from packaging.version import Version

from mcp_forge.errors import PackageError, PackageNotFound, PackageTooLarge
from mcp_forge.image.kernel import PYTHON_VERSION

PAGE_MAX = 20_000_000  # bytes of one project's index page
TIMEOUT = 60.0  # seconds for one request to the index
_JSON = "application/vnd.pypi.simple.v1+json"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Sdist:
    """One source distribution on the index."""

    filename: str
    url: str
    sha256: str
    name: str  # normalized
    version: Version


def choose(req: Requirement, files: list[dict[str, Any]]) -> Sdist:
    """The newest sdist of `files` (the index's entries) that `req` allows, for the
    kernel's Python; PackageNotFound if none."""
    python = Version(PYTHON_VERSION)
    best: Sdist | None = None
    for entry in files:
        filename = str(entry.get("filename", ""))
        try:
            name, version = parse_sdist_filename(filename)
        except InvalidSdistFilename:
            continue  # a wheel, or a name that is not a distribution's
        if name != canonicalize_name(req.name) or entry.get("yanked"):
            continue
        if not req.specifier.contains(version, prereleases=bool(req.specifier.prereleases)):
            continue
        try:
            if not SpecifierSet(str(entry.get("requires-python") or "")).contains(python):
                continue
        except InvalidSpecifier:
            continue
        sha = str((entry.get("hashes") or {}).get("sha256", "")).lower()
        if not _SHA256.match(sha) or (best is not None and version <= best.version):
            continue
        best = Sdist(filename, str(entry.get("url", "")), sha, name, version)
    if best is None:
        raise PackageNotFound(
            f"no wheel and no source distribution of {str(req)!r} for the kernel "
            f"(CPython {PYTHON_VERSION}) on the package index"
        )
    return best


async def find(req: Requirement, index_url: str) -> Sdist:
    """The sdist of `req` to build, from the index at `index_url`."""
    page = urllib.parse.urljoin(index_url.rstrip("/") + "/", f"{canonicalize_name(req.name)}/")
    body, kind, final = await asyncio.to_thread(_get, page, PAGE_MAX, _JSON + ", text/html;q=0.1")
    files = await asyncio.to_thread(_files, body, kind)
    for entry in files:
        entry["url"] = urllib.parse.urljoin(final, str(entry.get("url", "")))
    return choose(req, files)


async def fetch(sdist: Sdist, dest: Path, file_max: int) -> Path:
    """Download `sdist` into `dest`, at most `file_max` bytes, checked against its hash."""
    if urllib.parse.urlsplit(sdist.url).scheme not in ("https", "http"):
        raise PackageError(f"the index gave {sdist.filename!r} a URL that is not HTTP(S)")
    body, _, _ = await asyncio.to_thread(_get, sdist.url, file_max, "*/*")
    if hashlib.sha256(body).hexdigest() != sdist.sha256:
        raise PackageError(f"{sdist.filename!r} does not match the sha256 the index gives")
    path = dest / sdist.filename
    await asyncio.to_thread(path.write_bytes, body)
    return path


class _HttpOnly(urllib.request.HTTPRedirectHandler):
    """Redirects to http(s) only (urllib's own would follow one to ftp:)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        if urllib.parse.urlsplit(newurl).scheme not in ("https", "http"):
            raise urllib.error.HTTPError(newurl, code, "a redirect out of http(s)", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_HttpOnly())


def shown_url(url: str) -> str:
    """`url` without its user information (a private index's credentials)."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc="…@" + parts.netloc.rsplit("@", 1)[1]).geturl()


def _get(url: str, most: int, accept: str) -> tuple[bytes, str, str]:
    """The body (at most `most` bytes), content type and final URL of a GET."""
    shown = shown_url(url)
    try:
        request = urllib.request.Request(url, headers={"Accept": accept})
        with _OPENER.open(request, timeout=TIMEOUT) as answer:
            body = answer.read(most + 1)
            kind = answer.headers.get("Content-Type", "")
            final = answer.geturl()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise PackageNotFound(f"the package index has no project at {shown}") from None
        raise PackageError(f"the package index answered {exc.code} for {shown}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        why = type(exc).__name__
        raise PackageError(f"the package index was not reached ({shown}): {why}") from None
    if len(body) > most:
        raise PackageTooLarge(f"{shown} is over {most} bytes")
    return body, kind, final


def _files(body: bytes, kind: str) -> list[dict[str, Any]]:
    if kind.startswith(_JSON):
        return _json_files(body)
    return _html_files(body.decode("utf-8", "replace"))


def _json_files(body: bytes) -> list[dict[str, Any]]:
    try:
        files = json.loads(body).get("files")
    except (ValueError, AttributeError, RecursionError):
        raise PackageError("the package index's JSON answer is malformed") from None
    if not isinstance(files, list):
        raise PackageError("the package index's JSON answer has no list of files")
    return [dict(f) for f in files if isinstance(f, dict)]


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.files: list[dict[str, Any]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag != "a":
            return
        a = dict(attrs)
        href = a.get("href") or ""
        url, _, fragment = href.partition("#")
        algo, _, digest = fragment.partition("=")
        self.files.append(
            {
                "filename": urllib.parse.unquote(url.rstrip("/").rsplit("/", 1)[-1]),
                "url": url,
                "hashes": {algo: digest} if algo and digest else {},
                "requires-python": a.get("data-requires-python") or "",
                "yanked": "data-yanked" in a,
            }
        )


def _html_files(text: str) -> list[dict[str, Any]]:
    parser = _Anchors()
    parser.feed(text)
    parser.close()
    return parser.files
