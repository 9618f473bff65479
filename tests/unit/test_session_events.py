"""Which Events a KernelSession's status change deserves (control/events.py `changes`);
written to the real API server: tests/kube/test_operator.py."""

from __future__ import annotations

from typing import Any

import pytest

from mcp_forge.api import status as st
from mcp_forge.control.events import NORMAL, WARNING, changes

OOM = {"reason": "OOMKilled", "message": "killed: out of memory (limit 256Mi)", "at": "T2",
       "kernelId": "k1"}  # fmt: skip
WARM = {"type": "WarmStart", "status": "True", "message": "claimed kernel p-1 of pool warm"}


@pytest.mark.parametrize(
    ("old", "new", "want"),
    [
        ({}, {"phase": st.PENDING}, []),
        ({"phase": st.PENDING}, {"phase": st.STARTING, "podName": "ks-a"},
         [(NORMAL, "Starting", "kernel pod ks-a made")]),
        ({"phase": st.STARTING}, {"phase": st.READY, "message": "the kernel answered"},
         [(NORMAL, "Ready", "the kernel answered")]),
        ({"phase": st.READY}, {"phase": st.READY, "message": "still"}, []),  # no change
        ({"phase": st.READY}, {"phase": st.RESTARTING, "reason": "OOMKilled",
                               "message": OOM["message"], "lastTermination": OOM},
         [(WARNING, "OOMKilled", OOM["message"])]),  # the death says why it restarts
        ({"phase": st.READY}, {"phase": st.RESTARTING, "reason": st.RESTART_REQUESTED,
                               "message": "asked"}, [(NORMAL, st.RESTART_REQUESTED, "asked")]),
        ({"phase": st.READY}, {"phase": st.RESTARTING, "reason": "Error", "message": "exit 1"},
         [(WARNING, "Error", "exit 1")]),  # its death recorded apart
        ({"phase": st.RESTARTING, "reason": "Error"},
         {"phase": st.RESTARTING, "reason": st.CRASH_LOOP_BACKOFF, "message": "back off 20s"},
         [(WARNING, st.CRASH_LOOP_BACKOFF, "back off 20s")]),
        ({"phase": st.READY}, {"phase": st.SUSPENDED, "reason": st.IDLE, "message": "idle 2s"},
         [(NORMAL, "Suspended", "idle 2s")]),
        ({"phase": st.SUSPENDED}, {"phase": st.STARTING, "podName": "ks-a"},
         [(NORMAL, "Resumed", "kernel pod ks-a made")]),
        ({"phase": st.STARTING}, {"phase": st.FAILED, "reason": "InvalidSpec", "message": "bad"},
         [(WARNING, "InvalidSpec", "bad")]),
        ({"phase": st.STARTING}, {"phase": st.READY, "message": "ok", "conditions": [WARM]},
         [(NORMAL, "Claimed", WARM["message"]), (NORMAL, "Ready", "ok")]),
        ({"phase": st.READY, "conditions": [WARM]}, {"phase": st.READY, "conditions": [WARM]},
         []),  # claimed once: said once
        ({"phase": st.READY, "lastTermination": OOM},
         {"phase": st.READY, "lastTermination": OOM}, []),  # the same death: said once
    ],
)  # fmt: skip
def test_a_status_change_gets_the_events_a_person_wants(
    old: dict[str, Any], new: dict[str, Any], want: list[tuple[str, str, str]]
) -> None:
    assert changes(old, new) == want
