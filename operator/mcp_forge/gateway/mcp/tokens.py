"""Bearer tokens for the HTTP gateway: each token is one client's credential.

Three sources, first found wins: a tokens file (one `NAME TOKEN` per line, a client
each), one token given on the command line or in MCPFORGE_TOKEN (client "default"), or
a token generated once and kept 0600 in the state directory (client "default").
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from mcp_forge.errors import InvalidRequest

TOKEN_MIN = 16
GENERATED = "gateway-token"


def load(state_dir: Path, given: str | None, tokens_file: str | None) -> tuple[dict[str, str], str]:
    """Tokens (token → client name), and where they came from."""
    if tokens_file:
        return _from_file(Path(tokens_file)), tokens_file
    if given:
        if len(given) < TOKEN_MIN:
            raise InvalidRequest(f"the token must be at least {TOKEN_MIN} characters")
        return {given: "default"}, "--token / MCPFORGE_TOKEN"
    path = state_dir / GENERATED
    return {_generated(path): "default"}, str(path)


def _from_file(path: Path) -> dict[str, str]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InvalidRequest(f"cannot read the tokens file {path}: {exc.strerror}") from None
    tokens: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or len(parts[1]) < TOKEN_MIN:
            raise InvalidRequest(f"{path}:{number}: expected NAME TOKEN ({TOKEN_MIN}+ characters)")
        name, token = parts
        if token in tokens:
            raise InvalidRequest(f"{path}:{number}: this token is already given to {tokens[token]}")
        tokens[token] = name
    if not tokens:
        raise InvalidRequest(f"{path} names no client")
    return tokens


def _generated(path: Path) -> str:
    """The stored token, made (0600) if there is none; refused if others can read it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            raise InvalidRequest(
                f"{path} must be private (chmod 600): it holds the token"
            ) from None
        token = path.read_text().strip()
        if len(token) < TOKEN_MIN:
            raise InvalidRequest(
                f"{path} holds no usable token; delete it to make a new one"
            ) from None
        return token
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
