"""The CRDs in crds/: how kubectl applies, explains and lists them, and the status they keep."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from manifests_support import MANIFESTS, key, kustomize

from mcp_forge.api.status import Status


def test_the_crds_apply_with_f_and_with_k_alike() -> None:
    """`kubectl apply -f crds/` takes the directory's .yaml, .yml and .json files: the CRDs
    and nothing else (no kustomization), the same objects `-k crds` builds."""
    crds = MANIFESTS.parent / "crds"
    read = [p for p in crds.iterdir() if p.suffix in (".yaml", ".yml", ".json")]
    objs = [o for p in sorted(read) for o in yaml.safe_load_all(p.read_text()) if o]
    assert {o["kind"] for o in objs} == {"CustomResourceDefinition"}, [p.name for p in read]
    assert sorted(key(o) for o in objs) == sorted(key(o) for o in kustomize(crds))


@pytest.mark.parametrize("crd", ["kernelsession.yaml", "kernelsessionpool.yaml"])
def test_kubectl_explain_has_a_description_for_every_field(crd: str) -> None:
    doc = yaml.safe_load((MANIFESTS.parent / "crds" / crd).read_text())
    schema = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    missing = [] if schema.get("description") else ["(the kind)"]

    def walk(node: dict[str, Any], path: str) -> None:
        for name, prop in (node.get("properties") or {}).items():
            if name in ("apiVersion", "kind", "metadata"):
                continue
            if not prop.get("description"):
                missing.append(f"{path}.{name}")
            walk(prop, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(schema, "")
    assert missing == [], missing


def test_kubectl_get_o_wide_shows_reason_image_pod_pool_node_and_snapshot() -> None:
    doc = yaml.safe_load((MANIFESTS.parent / "crds" / "kernelsession.yaml").read_text())
    columns = doc["spec"]["versions"][0]["additionalPrinterColumns"]
    wide = {c["name"]: c["jsonPath"] for c in columns if c.get("priority") == 1}
    assert wide == {
        "Reason": ".status.reason",
        "Image": ".spec.image",
        "Pod": ".status.podName",
        "Pool": ".spec.poolRef.name",
        "Node": ".status.nodeName",
        "Snapshot": ".status.snapshot.takenAt",
        "Restore": ".status.lastRestore.outcome",
    }


def test_every_status_field_is_in_the_crd_so_the_api_server_keeps_it() -> None:
    """The API server prunes what the schema does not name: each field of Status (and of
    its snapshot and lastRestore) is in the CRD's status schema."""
    doc = yaml.safe_load((MANIFESTS.parent / "crds" / "kernelsession.yaml").read_text())
    schema = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert set(Status.__annotations__) <= set(schema["properties"])
    snapshot = schema["properties"]["snapshot"]["properties"]
    # local mode's (runtimes/local/naps.py), a cluster's node and archive (control/
    # snapshots.py), whether a batch of forks shares it (control/forking.py), and its copy
    # in the session's claim (control/snapstore.py)
    assert set(snapshot) == {
        "size", "takenAt", "seconds", "inPod", "node", "archive", "shared", "stored"
    }  # fmt: skip
    assert set(snapshot["stored"]["properties"]) == {
        "outcome", "claim", "at", "seconds", "message"
    }  # fmt: skip
    assert snapshot["stored"]["properties"]["outcome"]["enum"] == ["Storing", "Stored", "Failed"]
    assert set(schema["properties"]["lastRestore"]["properties"]) == {
        "outcome",
        "at",
        "seconds",
        "message",
    }
    fork = schema["properties"]["fork"]["properties"]
    assert set(fork) == {"from", "outcome", "at", "message", "workspace"}
    assert set(fork["workspace"]["properties"]) == {"outcome", "message", "at", "stopping"}
