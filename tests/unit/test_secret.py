"""Secrets (v1) in local mode: validated as the API server would, stored 0600, resolved
into a session's env; no message ever holds a value."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import pytest

from mcp_forge.api import kernelsessionpool as ksp
from mcp_forge.api import secret
from mcp_forge.api import status as st
from mcp_forge.errors import InvalidSession, SecretError
from mcp_forge.runtimes.local.secrets import Secrets
from mcp_forge.runtimes.local.store import Store
from support import kernel_session

VALUE = "hunter2-value"


def body(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "api-keys"}, **fields}


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_string_data_is_merged_into_data_as_base64_and_wins() -> None:
    out = secret.validate(
        body(data={"a": b64("from data"), "b": b64("old")}, stringData={"b": VALUE})
    )
    assert out["metadata"] == {"name": "api-keys", "namespace": "default"}
    assert out["type"] == "Opaque"
    assert out["data"] == {"a": b64("from data"), "b": b64(VALUE)}
    loaded = secret.load(out)
    assert loaded.keys == ["a", "b"] and loaded.data["b"] == VALUE.encode()
    assert VALUE not in repr(loaded) and b64(VALUE) not in repr(loaded)


@pytest.mark.parametrize(
    ("obj", "field", "words"),
    [
        (body(apiVersion="v2"), "apiVersion", "v1"),
        (body(metadata={}), "metadata.name", "required"),
        (body(metadata={"name": "Bad_Name"}), "metadata.name", "DNS subdomain"),
        (body(metadata={"name": "a" * 254}), "metadata.name", "253"),
        (body(metadata={"name": "s", "namespace": "Bad"}), "metadata.namespace", "namespace"),
        (body(metadata={"name": "s", "finalizers": []}), "metadata.finalizers", "unknown"),
        (body(spec={}), "spec", "unknown field"),
        (body(data=["x"]), "data", "mapping"),
        (body(data={"k": "not base64!" + VALUE}), "data.k", "base64"),
        (body(stringData={"k": 12345}), "stringData.k", "not int"),
        (body(stringData={"a/b": VALUE}), "stringData", "a-z, A-Z"),
        (body(stringData={"k" * 254: VALUE}), "stringData", "253"),
        (body(stringData={"k": "x" * (secret.MAX_BYTES + 1)}), "data", "1 MiB"),
        (body(type=""), "type", "non-empty"),
        (body(immutable="yes"), "immutable", "boolean"),
    ],
)
def test_an_invalid_secret_names_the_field_and_never_its_value(
    obj: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(InvalidSession) as err:
        secret.validate(obj)
    assert err.value.field == field
    assert words in str(err.value)
    assert VALUE not in str(err.value)


def test_a_secret_of_exactly_one_mib_is_accepted() -> None:
    out = secret.validate(body(stringData={"k": "x" * (secret.MAX_BYTES - 1)}))
    assert len(secret.load(out).data["k"]) == secret.MAX_BYTES - 1


def test_a_yaml_stream_takes_secrets_and_a_yaml_error_shows_no_line_of_it() -> None:
    text = (
        "apiVersion: v1\nkind: Secret\nmetadata: {name: s}\nstringData: {k: v}\n---\n"
        "apiVersion: mcpforge.dev/v1alpha1\nkind: KernelSession\nmetadata: {name: x}\n"
    )
    assert [d["kind"] for d in ksp.parse_resources(text)] == ["Secret", "KernelSession"]
    broken = f'kind: Secret\nstringData:\n  token: {VALUE}: "x\n'
    with pytest.raises(InvalidSession) as err:
        ksp.parse_resources(broken)
    assert "line 3" in str(err.value) and VALUE not in str(err.value)


def env_session() -> Any:
    ref = {"secretKeyRef": {"name": "api-keys", "key": "token"}}
    return kernel_session(
        env=[{"name": "PLAIN", "value": "p"}, {"name": "TOKEN", "valueFrom": ref}]
    )


def test_a_session_resolves_its_secret_env_and_a_claim_gets_it(tmp_path: Path) -> None:
    secrets = Secrets(Store(tmp_path / "store.db"))
    stored, action = secrets.apply(body(stringData={"token": VALUE}))
    assert (stored.name, action) == ("api-keys", "created")
    assert secrets.apply(body(stringData={"token": VALUE}))[1] == "unchanged"
    session = env_session()
    assert secrets.values(session) == {"TOKEN": VALUE}
    env = ksp.claim_env(session, secret_values=secrets.values(session))
    assert env == {"PLAIN": "p", "TOKEN": VALUE, "MCPFORGE_SESSION": "demo"}
    with pytest.raises(InvalidSession, match="TOKEN"):
        ksp.claim_env(session)  # never a claim without its Secret's value
    assert secrets.apply(body(stringData={"token": "new"}))[1] == "configured"


@pytest.mark.parametrize(
    ("stored", "reason", "words"),
    [
        (None, st.SECRET_NOT_FOUND, "Secret 'api-keys' not found in namespace 'default'"),
        ({"other": VALUE}, st.SECRET_NOT_FOUND, "has no key 'token' (it has: other)"),
        ({"token": VALUE + "\0"}, st.INVALID_SECRET, "no NUL byte"),
    ],
    ids=["no-secret", "no-key", "nul"],
)
def test_a_missing_secret_or_key_is_named_without_a_value(
    tmp_path: Path, stored: dict[str, str] | None, reason: str, words: str
) -> None:
    secrets = Secrets(Store(tmp_path / "store.db"))
    if stored is not None:
        secrets.apply(body(stringData=stored))
    with pytest.raises(SecretError) as err:
        secrets.values(env_session())
    assert err.value.reason == reason
    assert words in str(err.value) and "spec.env TOKEN" in str(err.value)
    assert VALUE not in str(err.value)


def test_secrets_are_listed_deleted_and_kept_in_a_private_file(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    secrets = Secrets(Store(path))
    secrets.apply(body(stringData={"token": VALUE}))
    secrets.apply(body(metadata={"name": "other", "namespace": "team"}, data={"a": b64("x")}))
    assert [(s.namespace, s.name, s.keys) for s in secrets.all()] == [
        ("default", "api-keys", ["token"]),
        ("team", "other", ["a"]),
    ]
    assert [s.name for s in secrets.all("team")] == ["other"]
    for f in tmp_path.iterdir():  # the database and SQLite's WAL files beside it
        assert f.stat().st_mode & 0o077 == 0, (f, oct(f.stat().st_mode))
        assert f.stat().st_uid == os.geteuid()
    secrets.delete("api-keys")
    with pytest.raises(SecretError, match="no Secret 'api-keys'"):
        secrets.delete("api-keys")
    assert [s.name for s in secrets.all()] == ["other"]


def test_a_pool_serves_a_session_whose_env_takes_secrets() -> None:
    """The claim gives the values (locally the runtime, on a cluster the gateway)."""
    pool = ksp.load(
        ksp.validate(
            {
                "apiVersion": "mcpforge.dev/v1alpha1",
                "kind": "KernelSessionPool",
                "metadata": {"name": "warm"},
                "spec": {"size": 1, "template": {"resources": {"memory": "512Mi"}}},
            }
        )
    )
    assert ksp.unservable(pool, env_session().body["spec"]) == ""
