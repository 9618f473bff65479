"""Gives a kernel claimed from a pool its session's environment and working files.

Run silently by the gateway (api/kernelsessionpool.claim_program) in globals of its own
holding ENV (the variables), FILES ([path, text] pairs), MARK (the variable naming the
claim) and ROOT (the workspace): nothing is left in the user's namespace. Files are
written below ROOT where no file of that path exists (a file the code changed is kept).
With MARK in ENV, all of it is done once per kernel: a kernel that already has that
mark (a gateway connecting again, a second replica) keeps what its code made of them.
"""

from __future__ import annotations

import os
from typing import Any


def give(env: dict[str, str], files: list[list[str]], mark: str, root: str) -> None:
    claimed = env.get(mark)
    if claimed is not None and os.environ.get(mark) == claimed:
        return
    os.environ.update(env)
    for path, text in files:
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        try:
            with open(full, "x", encoding="utf-8") as f:
                f.write(text)
        except FileExistsError:
            pass


_given: dict[str, Any] = globals()
if "ENV" in _given:
    give(_given["ENV"], _given["FILES"], _given["MARK"], _given["ROOT"])
