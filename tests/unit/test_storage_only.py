"""What housekeeping takes for a storage-only container of ours (runtimes/local/orphans.py),
from rows as Podman 4.3.1's `podman ps -a --external --format json` prints them."""

from __future__ import annotations

from typing import Any

from mcp_forge.runtimes.local.orphans import kernel_container, name_in_use, storage_only
from support import kernel_session


def row(name: str, state: str = "storage", command: str = "storage", **more: Any) -> dict[str, Any]:
    return {
        "Id": f"id-of-{name}",
        "Names": [name],
        "State": state,
        "Command": [command],
        "Labels": None,
        "Pod": "",
        **more,
    }


def test_only_podmans_own_containers_that_only_the_storage_holds_are_taken() -> None:
    ours = row("mcpforge-default-demo-kernel")
    rows = [
        ours,
        row("mcpforge-default-b-kernel", command="buildah"),  # a buildah working container
        row("mcpforge-default-c-kernel", state="running", command="sleep"),  # in the database
        row("mcpforge-default-d-kernel", state="exited", command="python"),
        {**row("mcpforge-default-e-kernel"), "Names": []},
        {**row("mcpforge-default-f-kernel"), "Id": ""},
    ]
    assert storage_only(rows) == {"mcpforge-default-demo-kernel": ours["Id"]}
    assert storage_only([]) == {}


def test_a_sessions_kernel_container_is_named_after_the_pod_it_owns() -> None:
    session = kernel_session()
    assert kernel_container(session) == "mcpforge-default-demo-kernel"
    session.body["status"] = {"podName": "mcpforge-default-pool-1a2b3c4d"}  # a claimed kernel
    assert kernel_container(session) == "mcpforge-default-pool-1a2b3c4d-kernel"


def test_a_name_in_use_is_read_from_podmans_error() -> None:
    said = (
        'Error: creating container storage: the container name "mcpforge-default-demo-kernel"'
        " is already in use by 883f2b91d9c62a10e470707afd020a17a37ef86244c90d0baf35691f435b03f3."
        " You have to remove that container to be able to reuse that name: that name is already"
        " in use\n"
    )
    assert name_in_use(said) == "mcpforge-default-demo-kernel"
    assert name_in_use("Error: no such image") is None
