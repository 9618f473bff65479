"""The KernelSessionPool resource (api/kernelsessionpool.py, crds/kernelsessionpool.yaml):
validation, the template it serves, and the code that gives a claimed kernel its env."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from mcp_forge.api import kernelsession as ks
from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.errors import InvalidSession


def pool(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSessionPool",
        "metadata": {"name": "warm"},
        "spec": {"size": 2, **spec},
    }


def session_spec(**spec: Any) -> dict[str, Any]:
    body = {
        "apiVersion": "mcpforge.dev/v1alpha1",
        "kind": "KernelSession",
        "metadata": {"name": "s"},
        "spec": {"poolRef": {"name": "warm"}, **spec},
    }
    validated: dict[str, Any] = ks.validate(body)["spec"]
    return validated


def test_the_template_has_the_kernelsession_schema_of_each_field_it_holds() -> None:
    session = ks.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    pools = ks.crd(ksp.CRD_FILE)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    template = pools["properties"]["spec"]["properties"]["template"]["properties"]
    assert set(template) == set(ksp.TEMPLATE_FIELDS)
    for field in ksp.TEMPLATE_FIELDS:
        assert template[field] == session["properties"]["spec"]["properties"][field], field


def test_defaults_are_applied_and_the_template_defaults_to_a_default_session() -> None:
    body = ksp.validate(pool())
    loaded = ksp.load(body)
    assert (loaded.size, loaded.max_starting) == (2, 2)
    assert loaded.template == {k: session_spec()[k] for k in ksp.TEMPLATE_FIELDS}
    assert ksp.unservable(loaded, session_spec()) == ""


@pytest.mark.parametrize(
    ("spec", "field", "says"),
    [
        ({"size": -1}, "spec.size", "minimum"),
        ({"size": "2"}, "spec.size", "type integer"),
        ({"template": {"resources": {"memory": "lots"}}}, "spec.template.resources.memory", ""),
        ({"template": {"resources": {"memory": "32Mi"}}}, "spec.template.resources.memory", "64"),
        ({"template": {"env": []}}, "spec.template.env", "unknown field"),
        ({"replicas": 2}, "replicas", "unknown field"),
        ({"maxSize": 1}, "spec.maxSize", "at least spec.size (2), got 1"),
        ({"maxSize": 0}, "spec.maxSize", "minimum"),
        (
            {"template": {"network": {"allow": [{"host": "a..example"}]}}},
            "spec.template.network.allow[0].host",
            "label",
        ),
        (
            {"template": {"network": {"allow": [{"host": "a.example", "ports": [70000]}]}}},
            "spec.template.network.allow[0].ports[0]",
            "maximum",
        ),
        (
            {"template": {"network": {"egress": "All", "allow": [{"host": "pypi.org"}]}}},
            "spec.template.network.allow",
            "an allow-list needs egress None",
        ),
    ],
)
def test_a_bad_pool_is_refused_naming_the_field(
    spec: dict[str, Any], field: str, says: str
) -> None:
    body = pool()
    body["spec"].update(spec)
    with pytest.raises(InvalidSession) as caught:
        ksp.validate(body)
    assert caught.value.field is not None and caught.value.field.endswith(field)
    assert says in str(caught.value)


@pytest.mark.parametrize(
    ("size", "max_size", "claimed", "wanted"),
    [
        (3, None, 50, 3),  # no maximum: claims change nothing
        (3, 10, 0, 3),
        (3, 10, 7, 3),  # 7 + 3 = 10: still room for all three
        (3, 10, 8, 2),
        (3, 10, 10, 0),
        (3, 10, 12, 0),  # lowered below what is claimed
    ],
)
def test_a_maximum_counts_claimed_kernels_against_the_ready_ones(
    size: int, max_size: int | None, claimed: int, wanted: int
) -> None:
    extra = {"maxSize": max_size} if max_size else {}
    loaded = ksp.load(ksp.validate(pool(size=size, **extra)))
    assert loaded.wanted(claimed) == wanted
    ok, reason, message = loaded.condition(wanted, claimed)  # as many ready as wanted
    assert ok
    if wanted < size:
        assert reason == ksp.AT_MAXIMUM
        assert (
            message == f"{wanted} of {size} kernels ready: at its maximum of 10 ({claimed} claimed)"
        )
    else:
        assert (reason, message) == ("Filled", f"{size} of {size} kernels ready")
    if wanted:
        assert loaded.condition(wanted - 1, claimed)[:2] == (False, "Filling")


def test_a_pool_name_leaves_room_for_its_kernels_names() -> None:
    body = pool()
    body["metadata"]["name"] = "p" * 32
    with pytest.raises(InvalidSession, match="at most 31"):
        ksp.validate(body)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"image": "localhost/other:1"}, "spec.image"),
        ({"resources": {"memory": "2Gi"}}, "spec.resources"),
        ({"resources": {"pids": 512}}, "spec.resources"),
        ({"workspace": {"size": "5Gi"}}, "spec.workspace"),
        ({"network": {"egress": "All"}}, "spec.network"),
        ({"sharedGroup": "team"}, "sharedGroup"),
        ({"env": [{"name": "PYTHONPATH", "value": "/w"}]}, "PYTHONPATH"),
        ({"env": [{"name": "LD_PRELOAD", "value": "x.so"}]}, "LD_PRELOAD"),
        ({"operatingMode": "Suspended"}, "Suspended"),
        ({"workspace": {"persistent": True}}, "spec.workspace is persistent"),
        ({"workspace": {"storageClassName": "fast"}}, "spec.workspace is persistent"),
    ],
)
def test_what_a_pool_cannot_serve_is_named(spec: dict[str, Any], says: str) -> None:
    why = ksp.unservable(ksp.load(ksp.validate(pool())), session_spec(**spec))
    assert says in why


def test_a_template_allow_list_is_kept_and_serves_sessions_with_the_same_list() -> None:
    network = {"egress": "None", "allow": [{"host": "pypi.org"}, {"host": "*.pythonhosted.org"}]}
    warm = ksp.load(ksp.validate(pool(template={"network": network})))
    assert warm.template["network"] == network
    assert ksp.unservable(warm, session_spec(network=network)) == ""
    other = {"egress": "None", "allow": [{"host": "pypi.org"}]}
    assert "spec.network" in ksp.unservable(warm, session_spec(network=other))
    assert "spec.network" in ksp.unservable(warm, session_spec())


def test_a_workspace_said_not_persistent_is_served_and_a_template_cannot_be_persistent() -> None:
    warm = ksp.load(ksp.validate(pool()))
    spec = session_spec(workspace={"persistent": False, "reclaimPolicy": "Delete"})
    assert ksp.unservable(warm, spec) == "", "only the size is the pod's"
    with pytest.raises(InvalidSession, match=r"spec\.template\.workspace: a pooled kernel"):
        ksp.validate(pool(template={"workspace": {"persistent": True}}))


def test_what_is_given_at_claim_time_is_served() -> None:
    spec = session_spec(
        env=[{"name": "API_TOKEN", "value": "x"}, {"name": "OMP_NUM_THREADS", "value": "1"}],
        idleTimeout="5m",
        mcpServers=[{"name": "time"}],
        restartPolicy="Never",
        maxLifetime="1h",
    )
    assert ksp.unservable(ksp.load(ksp.validate(pool())), spec) == ""


def test_a_pool_is_chosen_when_it_serves_the_spec_the_one_with_most_ready_first() -> None:
    def loaded(name: str, ready: int | None, **template: Any) -> ksp.KernelSessionPool:
        body = ksp.validate({**pool(template=template), "metadata": {"name": name}})
        return ksp.load({**body, "status": {} if ready is None else {"ready": ready}})

    big = loaded("big", 5, resources={"memory": "2Gi"})
    empty, fresh, full = loaded("empty", 0), loaded("fresh", None), loaded("full", 2)
    assert ksp.choose([empty, full, big], session_spec()) == full
    assert ksp.choose([fresh, empty], session_spec()) == empty, "a tie goes by name"
    assert ksp.choose([empty], session_spec()) == empty, "an empty one too: its miss is counted"
    assert ksp.choose([empty, full], session_spec(resources={"memory": "2Gi"})) is None
    assert ksp.choose([empty, full, big], session_spec(resources={"memory": "2Gi"})) == big
    assert ksp.choose([], session_spec()) is None


def test_a_template_change_changes_the_hash_and_a_reordering_does_not() -> None:
    a = ksp.load(ksp.validate(pool(template={"resources": {"memory": "1Gi", "cpu": "1"}})))
    b = ksp.load(ksp.validate(pool(template={"resources": {"cpu": "1", "memory": "1Gi"}})))
    c = ksp.load(ksp.validate(pool(template={"resources": {"memory": "2Gi"}})))
    assert a.template_hash == b.template_hash != c.template_hash


def test_a_member_is_the_template_never_culled_and_labelled() -> None:
    loaded = ksp.load(ksp.validate(pool()))
    member = ksp.member_body(loaded, "warm-0123abcd")
    assert member["metadata"]["labels"] == {
        ksp.LABEL_POOL: "warm",
        ksp.LABEL_TEMPLATE: loaded.template_hash,
    }
    assert (member["spec"]["idleTimeout"], member["spec"]["maxLifetime"]) == ("0", "0")
    assert {k: member["spec"][k] for k in ksp.TEMPLATE_FIELDS} == loaded.template


@pytest.mark.parametrize(
    "value",
    ["plain", "quote ' and \" both", "back\\slash\\", "new\nline", "emoji 😀 and é"],
)
def test_the_claim_program_sets_each_value_exactly(value: str) -> None:
    env = {"GIVEN": value, "MCPFORGE_SESSION": "s"}
    code = ksp.claim_program(env) + "\nimport os, json; print(json.dumps(os.environ['GIVEN']))"
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, check=True)
    assert json.loads(out.stdout) == value


def test_resources_of_both_kinds_are_parsed_from_one_stream() -> None:
    text = (
        "apiVersion: mcpforge.dev/v1alpha1\nkind: KernelSessionPool\n"
        "metadata: {name: warm}\nspec: {size: 1}\n---\n"
        "apiVersion: mcpforge.dev/v1alpha1\nkind: KernelSession\n"
        "metadata: {name: s}\nspec: {poolRef: {name: warm}}\n"
    )
    kinds = [b["kind"] for b in ksp.parse_resources(text)]
    assert kinds == ["KernelSessionPool", "KernelSession"]
    with pytest.raises(InvalidSession, match="document 2"):
        ksp.parse_resources(text.replace("poolRef: {name: warm}", "poolRef: {}"))
