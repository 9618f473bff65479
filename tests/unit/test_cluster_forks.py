"""A cluster's forks, the parts that are pure: which session is a fork and of what
(control/forking.py), which copies the gateway takes as refused (runtimes/
cluster_forks.py), and the program that makes a woken kernel the fork's (api/forks.py).
tests/kube/test_forks.py runs them on the test cluster."""

from __future__ import annotations

from typing import Any

import pytest

from mcp_forge.api import forks, kernelsession
from mcp_forge.api.kernelsessionpool import CLAIM_MARK
from mcp_forge.control.forking import WOKEN_CHECK, parent_of, ran
from mcp_forge.kernelside import run_silently
from mcp_forge.runtimes.cluster_forks import unforked


def session(annotations: dict[str, str] | None = None, **status: Any) -> Any:
    body = kernelsession.validate(
        {
            "apiVersion": "mcpforge.dev/v1alpha1",
            "kind": "KernelSession",
            "metadata": {"name": "copy", "namespace": "team", "annotations": annotations or {}},
            "spec": {"env": [{"name": "WHO", "value": "parent"}]},
        }
    )
    body["status"] = status
    return kernelsession.load(body)


def test_a_fork_names_its_parent_by_annotation_and_nothing_else_makes_one() -> None:
    assert parent_of(session({forks.FORKED_FROM: "elder"})) == "elder"
    assert parent_of(session()) is None
    assert parent_of(session({forks.FORKED_FROM: ""})) is None
    assert parent_of(session({"mcpforge.dev/other": "elder"})) is None


def test_the_gateway_refuses_only_copies_that_were_never_checkpointed() -> None:
    failed = {"from": "elder", "outcome": "Failed", "message": "snapshots are off"}
    assert unforked(session(fork=failed))
    # Checkpointed, then the restore failed: a new kernel that says so, returned as it is.
    restore = {"outcome": "Failed", "message": "mcpforge-runc: ..."}
    assert not unforked(session(fork=failed, lastRestore=restore))
    assert not unforked(session(fork={"from": "elder", "outcome": "Forked"}))
    # Ready, and no fork said of it: an operator that does not make forks.
    assert unforked(session())


def test_only_the_parents_woken_copy_passes_the_check_before_its_key_is_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check runs in the kernel (here, in this process: it binds nothing): a kernel
    whose environment names another session, a new one, is refused."""
    was = ("MCPFORGE_SESSION", "elder")
    check = run_silently(repr(WOKEN_CHECK), {"WAS": repr(was)})
    monkeypatch.setenv("MCPFORGE_SESSION", "elder")
    exec(check)  # the parent's woken copy: nothing raised
    monkeypatch.setenv("MCPFORGE_SESSION", "younger")
    with pytest.raises(RuntimeError, match="not a woken copy of 'elder'"):
        exec(check)
    assert "os" not in globals(), "nothing is left in the namespace it runs in"


def test_the_program_that_makes_a_kernel_the_forks_takes_the_names_given() -> None:
    parent = session()
    env = {"WHO": "fork", "QUOTE": 'it\'s "x"\n'}
    by_parent = forks.program("k" * 64, parent, env)
    assert by_parent == forks.becoming("k" * 64, sorted({"WHO", CLAIM_MARK}), env)
    # Its literals are Python's own: the env's values round-trip exactly.
    assert repr(env) in by_parent and repr([CLAIM_MARK, "WHO"]) in by_parent
    compile(by_parent, "<fork>", "exec")  # valid Python, not run here (it needs a kernel)


def test_only_a_session_that_never_ran_is_made_a_fork() -> None:
    """The annotation added to a session that ran replaces none of its memory or keys;
    a fork that waited (Pending, no kernel yet) still forks."""
    assert not ran({}) and not ran({"phase": "Pending", "restarts": 0, "kernelId": None})
    for kept in ("kernelId", "startedAt", "snapshot", "lastRestore", "lastTermination"):
        assert ran({kept: {"x": 1} if kept in ("snapshot", "lastRestore") else "x"}), kept
    assert ran({"restarts": 2})


def test_a_parent_is_held_by_its_forks_until_their_copies_end_or_their_time_runs_out() -> None:
    now = 1_800_000_000.0
    first = forks.hold({}, "copy-a", "uid-a", now)
    when = {"since": "2027-01-15T08:00:00Z", "until": "2027-01-15T08:30:00Z"}
    assert first == {"copy-a": {"uid": "uid-a", **when}}
    status = {forks.HOLDS: {**first, "stale": {"uid": "x", "until": "2027-01-15T07:00:00Z"}}}
    second = forks.hold(status, "copy-b", "uid-b", now + 60)
    assert second["stale"] is None and set(second) == {"stale", "copy-b"}  # past its time
    assert set(forks.live_holds(status, now)) == {"copy-a"}
    assert forks.live_holds(status, now + forks.HOLD_FOR) == {}
    assert forks.live_holds({forks.HOLDS: ["not", "a", "mapping"]}, now) == {}
    full = {forks.HOLDS: {f"f{i}": forks.hold({}, "", "", now + i)[""] for i in range(70)}}
    trimmed = forks.hold(full, "new", "uid", now)
    dropped = {k for k, v in trimmed.items() if v is None}
    assert len(dropped) == 70 - forks.HOLDS_MAX + 1 and "f69" not in dropped  # oldest first

    def fork(uid: str, **said: Any) -> dict[str, Any]:
        return {"metadata": {"uid": uid}, "status": {"fork": said}}

    assert forks.holding({"metadata": {"uid": "u"}}, "u")  # its checkpoint under way
    assert forks.holding(fork("u", outcome="Restoring"), "u")
    assert forks.holding(fork("u", outcome="Restoring", workspace={"stopping": True}), "u")
    assert not forks.holding(fork("u", outcome="Restoring", workspace={"outcome": "Copied"}), "u")
    assert not forks.holding(fork("u", outcome="Failed"), "u")
    stopped = fork("u", outcome="Restoring")
    stopped["status"]["phase"] = "Failed"  # it copies nothing more
    assert not forks.holding(stopped, "u")
    stopped["status"]["phase"] = "Suspended"  # its copy runs on, its end not yet recorded
    assert forks.holding(stopped, "u")
    assert not forks.holding(fork("other", outcome="Restoring"), "u")  # a new one of that name
    assert not forks.holding(None, "u")  # deleted
