"""Makes a kernel restored from another session's snapshot (a fork) the new session's.

Run silently by the host (runtimes/local/forks.py; on a cluster, the operator:
control/forking.py), in globals of its own holding get_ipython, KEY (the new session's
HMAC key), DROP (the names of the parent's session variables, and its claim mark), ENV
(the new session's variables) and WAS (None, or a variable and the value it must have: a
kernel that is not the parent's woken copy is refused, and nothing changes): the parent's are
taken out of the environment and the fork's put in, and the kernel signs with its own
key and a session id of its own from this request's reply on; IPython's history is
opened again in the fork's copy of it. Values its code copied elsewhere (a variable
holding a token) stay: a fork has its parent's memory.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any


def become(
    ipython: Any,
    key: str,
    drop: list[str],
    env: dict[str, str],
    was: tuple[str, str] | None = None,
) -> None:
    if was is not None and os.environ.get(was[0]) != was[1]:
        raise RuntimeError(f"not a woken copy of {was[1]!r}: {was[0]} says otherwise")
    for name in drop:
        os.environ.pop(name, None)
    os.environ.update(env)
    session = ipython.kernel.session  # the one Session the kernel's channels sign with
    session.key = key.encode()
    session.session = str(uuid.uuid4())
    reopen_history(ipython)


def reopen_history(ipython: Any) -> None:
    """IPython's history database opened again, and its saving thread started again.
    It is a file in /tmp, which the fork has a copy of: SQLite takes a database whose
    file is not the one it opened (another inode) for moved, and read-only. History is
    a convenience: a version of IPython this does not fit keeps it in memory instead."""
    history = getattr(ipython, "history_manager", None)
    if history is None:
        return
    try:
        history._stop_save_thread()
        history.db.close()
        history.init_db()
        history._restart_thread_if_stopped()
    except Exception:  # whatever this IPython is: history in memory
        with contextlib.suppress(Exception):
            history._switch_to_memory_history()


_given: dict[str, Any] = globals()
if "KEY" in _given:
    become(_given["get_ipython"](), _given["KEY"], _given["DROP"], _given["ENV"], _given.get("WAS"))
