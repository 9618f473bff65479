"""control/poolplan.plan: which of a pool's kernels go and how many start (pure)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import status as st
from mcp_forge.control.poolplan import (
    BACKOFF_MAX,
    LABEL_CLAIMED_FROM,
    Member,
    Trouble,
    claimed_from,
    plan,
    trouble,
)
from mcp_forge.control.render import LABEL_SESSION

NEW, OLD = "new", "old"


def member(
    n: int,
    *,
    template: str = NEW,
    ready: bool = True,
    failed: bool = False,
    deleting: bool = False,
) -> Member:
    return Member(f"m{n}", f"uid{n}", str(n), template, float(n), ready, failed, deleting)


def names(p: object) -> list[str]:
    return sorted(m.name for m in p.delete)  # type: ignore[attr-defined]


def test_an_empty_pool_starts_up_to_max_starting() -> None:
    p = plan([], size=5, max_starting=2, template=NEW)
    assert (p.start, p.ready, p.starting, p.delete) == (2, 0, 2, ())


def test_a_full_pool_does_nothing() -> None:
    p = plan([member(1), member(2)], size=2, max_starting=2, template=NEW)
    assert (p.start, p.ready, p.delete) == (0, 2, ())


def test_kernels_still_starting_count_against_max_starting() -> None:
    p = plan([member(1, ready=False)], size=4, max_starting=2, template=NEW)
    assert (p.start, p.starting) == (1, 2)


def test_a_failed_kernel_is_deleted_and_replaced() -> None:
    p = plan([member(1), member(2, failed=True)], size=2, max_starting=2, template=NEW)
    assert names(p) == ["m2"]
    assert p.start == 1


def test_a_kernel_being_deleted_is_not_counted_nor_deleted_again() -> None:
    p = plan([member(1), member(2, deleting=True)], size=2, max_starting=2, template=NEW)
    assert (names(p), p.start) == ([], 1)


def test_shrinking_removes_starting_kernels_first_then_the_newest() -> None:
    members = [member(1), member(2), member(3), member(4, ready=False)]
    p = plan(members, size=2, max_starting=2, template=NEW)
    assert names(p) == ["m3", "m4"]
    assert (p.start, p.ready) == (0, 2)


def test_a_template_change_replaces_old_kernels_only_as_new_ones_are_ready() -> None:
    old = [member(1, template=OLD), member(2, template=OLD)]
    # Nothing new yet: start new ones, keep every old one (they still serve nothing new,
    # but the pool never gets emptier than it was while the new ones start).
    p = plan(old, size=2, max_starting=2, template=NEW)
    assert (names(p), p.start) == ([], 2)
    # One new one is ready: one old one goes.
    p = plan([*old, member(3), member(4, ready=False)], size=2, max_starting=2, template=NEW)
    assert (names(p), p.start) == (["m1"], 0)
    # Both ready: the last old one goes.
    p = plan([old[1], member(3), member(4)], size=2, max_starting=2, template=NEW)
    assert (names(p), p.start, p.ready) == (["m2"], 0, 2)


def test_at_its_maximum_a_template_change_makes_way_for_new_kernels_within_room() -> None:
    old = [member(1, template=OLD), member(2, template=OLD, ready=False), member(3, template=OLD)]
    # Room for 3 (maxSize 4, one claimed), size 3: no place beside the old ones. Old
    # kernels go to make one, the one not ready first, then the oldest; never over room.
    p = plan(old, size=3, max_starting=1, template=NEW, room=3)
    assert (names(p), p.start) == (["m2"], 1)
    p = plan(old, size=3, max_starting=2, template=NEW, room=3)
    assert (names(p), p.start) == (["m1", "m2"], 2)
    # With room to spare the old ones stay while new ones start, as without a maximum.
    p = plan(old, size=3, max_starting=2, template=NEW, room=5)
    assert (names(p), p.start) == ([], 2)
    assert plan(old, size=3, max_starting=2, template=NEW) == p
    # Room for fewer than are current (claims came): no start, old ones all go.
    p = plan([member(4), member(5), *old], size=2, max_starting=2, template=NEW, room=2)
    assert (names(p), p.start) == (["m1", "m2", "m3"], 0)
    # An old kernel being deleted is still alive: the new one starts once it is gone.
    p = plan([member(1, template=OLD, deleting=True)], size=1, max_starting=1, template=NEW, room=1)
    assert (names(p), p.start) == ([], 0)
    assert plan([], size=1, max_starting=1, template=NEW, room=1).start == 1
    # Every plan keeps the pool within room, whatever it holds.
    going = member(6, template=OLD, deleting=True)
    for members in (
        [],
        old,
        [member(4), *old],
        [member(4, ready=False), member(5), *old],
        [going, member(4), *old],
    ):
        for room in range(5):
            p = plan(members, size=min(2, room), max_starting=2, template=NEW, room=room)
            kept = [m for m in members if m not in p.delete]  # with those being deleted
            assert len([m for m in kept if not m.deleting]) <= room, (room, p)
            assert not p.start or len(kept) + p.start <= room, (room, p)  # never starts over


def test_an_old_kernel_not_ready_goes_before_a_ready_one() -> None:
    old = [member(1, template=OLD), member(2, template=OLD, ready=False)]
    p = plan([*old, member(3)], size=2, max_starting=1, template=NEW)
    assert names(p) == ["m2"]


def test_size_zero_empties_the_pool() -> None:
    p = plan([member(1), member(2, template=OLD)], size=0, max_starting=2, template=NEW)
    assert names(p) == ["m1", "m2"]
    assert p.start == 0


def test_the_claim_program_gives_the_environment_once_per_kernel() -> None:
    import os

    saved = dict(os.environ)
    try:
        os.environ.pop(ksp.CLAIM_MARK, None)
        exec(ksp.claim_program({"A": "1", ksp.CLAIM_MARK: "k1"}))
        assert os.environ["A"] == "1"
        os.environ["A"] = "changed by the kernel's code"
        exec(ksp.claim_program({"A": "1", ksp.CLAIM_MARK: "k1"}))  # a gateway reconnects
        assert os.environ["A"] == "changed by the kernel's code"
        exec(ksp.claim_program({"A": "2", ksp.CLAIM_MARK: "k2"}))  # another kernel's claim
        assert os.environ["A"] == "2"
        exec(ksp.claim_program({"A": "3"}))  # no mark: always given
        assert os.environ["A"] == "3"
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_the_claim_program_writes_missing_files_only_and_leaves_no_name(tmp_path: Path) -> None:
    files = [("notes.md", "# hi\n"), ("data/deep/c.json", '{"k": "é \\"q\\""}')]
    namespace: dict[str, object] = {}
    exec(ksp.claim_program({}, files, root=str(tmp_path)), namespace)
    assert (tmp_path / "notes.md").read_text() == "# hi\n"
    assert (tmp_path / "data/deep/c.json").read_text(encoding="utf-8") == '{"k": "é \\"q\\""}'
    assert set(namespace) == {"__builtins__"}, "no name left behind"
    (tmp_path / "notes.md").write_text("changed")
    exec(ksp.claim_program({}, files, root=str(tmp_path)))
    assert (tmp_path / "notes.md").read_text() == "changed", "a changed file is kept"


def ks(name: str, pool: str = "warm", *, warm: bool = True, **status: Any) -> dict[str, Any]:
    conditions = [{"type": ksp.WARM_START, "status": "True" if warm else "False"}]
    return {
        "metadata": {"name": name},
        "spec": {"poolRef": {"name": pool}},
        "status": {"phase": "Ready", "conditions": conditions, **status},
    }


def claimed_pod(session: str, pool: str = "warm", **meta: Any) -> dict[str, Any]:
    labels = {LABEL_SESSION: session, LABEL_CLAIMED_FROM: pool}
    return {"metadata": {"name": f"ksp-{pool}-{session}", "labels": labels, **meta}}


def test_a_session_counts_against_its_pool_whichever_pod_runs_its_kernel() -> None:
    # "a": claimed, its pod being replaced (none now); "b": claimed, its pod running;
    # "c": claimed, its status not written yet; "d": started cold; "e": suspended;
    # "f": another pool's; "g": going.
    sessions = [
        ks("a"),
        ks("b"),
        ks("d", warm=False),
        ks("e", phase="Suspended"),
        ks("f", "other"),
        {**ks("g"), "metadata": {"name": "g", "deletionTimestamp": "2026-12-02T00:00:00Z"}},
    ]
    kernels = [
        claimed_pod("b"),
        claimed_pod("c"),
        claimed_pod("f", "other"),
        claimed_pod("h", deletionTimestamp="2026-12-02T00:00:00Z"),  # its session gone
    ]
    assert claimed_from("warm", sessions, kernels) == 3  # a, b (once), c
    assert claimed_from("other", sessions, kernels) == 1
    assert claimed_from("warm", [], []) == 0


def failing(n: int, template: str = "t1", reason: str = "ErrImagePull") -> Member:
    failed = member(n, template=template, ready=False, failed=True)
    return replace(failed, reason=reason, message=f"m{n}")


def test_failed_kernels_in_a_row_back_the_pool_off_then_stall_it() -> None:
    first = trouble(None, [failing(1)], [failing(1)], template="t1", now=100.0)
    assert first == Trouble(1, "ErrImagePull", "m1", 100.0, "t1")
    assert first.next_start(10.0) == 110.0 and not first.stalled
    second = trouble(first, [failing(2)], [failing(2)], template="t1", now=111.0)
    assert first is not None and second is not None
    assert (second.count, second.next_start(10.0)) == (2, 131.0)  # doubled
    third = trouble(second, [failing(3)], [failing(3)], template="t1", now=132.0)
    assert third is not None and third.stalled and third.next_start(10.0) == 172.0
    late = Trouble(20, "ErrImagePull", "", 0.0, "t1")
    assert late.next_start(10.0) == BACKOFF_MAX  # at most
    # Nothing failed this time: the trouble stays as it was.
    assert trouble(third, [failing(3)], [], template="t1", now=140.0) == third
    # Kept in the status and read back; anything else there is no trouble.
    assert Trouble.from_status(third.as_status()) == third
    for broken in (None, {}, {"count": "x", "at": "T"}, {"count": 0, "at": st.stamp(1.0)}):
        assert Trouble.from_status(broken) is None


def test_a_ready_kernel_or_a_new_template_clears_the_trouble() -> None:
    stalled = Trouble(3, "ErrImagePull", "", 100.0, "t1")
    ready = member(4, template="t1", ready=True)
    assert trouble(stalled, [ready], [], template="t1", now=200.0) is None
    assert trouble(stalled, [failing(5, "t2")], [], template="t2", now=200.0) is None
    fresh = trouble(stalled, [failing(5, "t2")], [failing(5, "t2")], template="t2", now=200.0)
    assert fresh is not None and fresh.count == 1 and fresh.template == "t2"
    # A kernel of the old template failing counts for nothing now.
    assert trouble(None, [failing(6, "t1")], [failing(6, "t1")], template="t2", now=1.0) is None
