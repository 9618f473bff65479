"""What a session may call upstream: per-server policy from spec.mcpServers. Pure.

    spec:
      mcpServers:
      - name: files                 # a server in the gateway's --mcp-config
        allow: ["read_*", "list_*"] # tool-name globs (default: every tool)
        deny: ["*secret*"]          # wins over allow
        readOnly: true              # only tools annotated readOnlyHint
        callsPerExecution: 100      # per execute_code call (default: unlimited)
        callsPerMinute: 600         # rate limit (default: unlimited)

A session gets no upstream server unless it names it.
"""

from __future__ import annotations

import collections
import fnmatch
import time
from dataclasses import dataclass
from typing import Any

from mcp_forge.api.quota import rate_refusal
from mcp_forge.errors import InvalidSession

FIELDS = {"name", "allow", "deny", "readOnly", "callsPerExecution", "callsPerMinute"}
GLOBS_MAX = 64


@dataclass(frozen=True)
class ServerPolicy:
    name: str
    allow: tuple[str, ...] = ("*",)
    deny: tuple[str, ...] = ()
    read_only: bool = False
    calls_per_execution: int | None = None
    calls_per_minute: int | None = None

    def refusal(self, tool: dict[str, Any]) -> str | None:
        """Why the session may not call `tool` (None: it may)."""
        name = str(tool.get("name", ""))
        if any(fnmatch.fnmatchcase(name, g) for g in self.deny):
            return f"{self.name}.{name} is denied by the session's policy"
        if not any(fnmatch.fnmatchcase(name, g) for g in self.allow):
            return f"{self.name}.{name} is not in the session's allowed tools"
        if self.read_only and not (tool.get("annotations") or {}).get("readOnlyHint"):
            return (
                f"{self.name}.{name} is not read-only, and the session allows only read-only tools"
            )
        return None


def _globs(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > GLOBS_MAX:
        raise InvalidSession(f"must be a list of at most {GLOBS_MAX} globs", field=where)
    if not all(isinstance(v, str) and 0 < len(v) <= 128 for v in value):
        raise InvalidSession("each glob is a string of 1-128 characters", field=where)
    return tuple(value)


def _count(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1_000_000:
        raise InvalidSession("must be an integer from 1 to 1000000", field=where)
    return value


def policies_of(
    servers: tuple[dict[str, Any], ...] | list[dict[str, Any]],
) -> dict[str, ServerPolicy]:
    """The policies of spec.mcpServers; InvalidSession naming the field."""
    out: dict[str, ServerPolicy] = {}
    for i, raw in enumerate(servers):
        at = f"spec.mcpServers[{i}]"
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise InvalidSession("must be an object with a name", field=at)
        unknown = set(raw) - FIELDS
        if unknown:
            raise InvalidSession(f"unknown field(s) {', '.join(sorted(unknown))}", field=at)
        read_only = raw.get("readOnly", False)
        if not isinstance(read_only, bool):
            raise InvalidSession("must be true or false", field=f"{at}.readOnly")
        out[raw["name"]] = ServerPolicy(
            raw["name"],
            allow=_globs(raw.get("allow", ["*"]), f"{at}.allow"),
            deny=_globs(raw.get("deny", []), f"{at}.deny"),
            read_only=read_only,
            calls_per_execution=_count(raw.get("callsPerExecution"), f"{at}.callsPerExecution"),
            calls_per_minute=_count(raw.get("callsPerMinute"), f"{at}.callsPerMinute"),
        )
    return out


class Meter:
    """Counts one session's calls per server: a budget per execution, a rate per minute.

    The rate counted here is this process's only; a gateway gives its bridges the
    runtime's shared count instead (Bridge's `rate`), which every replica sees."""

    def __init__(self) -> None:
        self._execution: collections.Counter[str] = collections.Counter()
        self._recent: dict[str, collections.deque[float]] = {}

    def new_execution(self) -> None:
        self._execution.clear()

    def over_budget(self, policy: ServerPolicy) -> str | None:
        """Why the execution may make no more calls to the server (None: it may)."""
        spent = self._execution[policy.name]
        if policy.calls_per_execution is not None and spent >= policy.calls_per_execution:
            return (
                f"the budget of {policy.calls_per_execution} calls to {policy.name} "
                "per execution is spent"
            )
        return None

    def take(
        self, policy: ServerPolicy, now: float | None = None, *, rate: bool = True
    ) -> str | None:
        """Count a call; why it may not be made (None: it may). Without `rate`, the
        rate is counted elsewhere (and was)."""
        t = time.monotonic() if now is None else now
        why = self.over_budget(policy)
        if why is not None:
            return why
        if rate and policy.calls_per_minute is not None:
            recent = self._recent.setdefault(policy.name, collections.deque())
            while recent and recent[0] <= t - 60.0:
                recent.popleft()
            if len(recent) >= policy.calls_per_minute:
                return rate_refusal(policy.name, policy.calls_per_minute)
            recent.append(t)
        self._execution[policy.name] += 1
        return None
