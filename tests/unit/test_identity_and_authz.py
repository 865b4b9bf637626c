"""Who may call what (core.authz) and how identities travel in certificates (core.identity):
every RPC of the contract has a rule, each role may make only its own calls, and a part acts
only for its own index."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchplane.core.authz import RULES, authorize
from batchplane.core.errors import InvalidArgument, PermissionDenied
from batchplane.core.identity import CERTIFIED_ROLES, ROLES, Identity, identity_of_names, parse_uri, server_name
from batchplane.v1 import constructor_pb2, loader_pb2, planner_pb2

SERVICES = [
    planner_pb2.DESCRIPTOR.services_by_name["Planner"],
    loader_pb2.DESCRIPTOR.services_by_name["Loader"],
    constructor_pb2.DESCRIPTOR.services_by_name["Constructor"],
]
METHODS = [f"/{s.full_name}/{m.name}" for s in SERVICES for m in s.methods]

identities = st.one_of(
    st.sampled_from(["planner", "operator"]).map(Identity),
    st.builds(Identity, st.just("constructor"), st.none() | st.integers(0, 10**6)),
    st.builds(Identity, st.just("loader"), st.integers(0, 10**6), st.none() | st.text(min_size=1, max_size=40)),
    st.just(Identity("loader")),
)


@given(identities)
def test_an_identity_survives_its_uri(identity: Identity) -> None:
    assert parse_uri(identity.uri()) == identity
    assert identity_of_names(["other.example", "spiffe://x/y", identity.uri()]) == identity


@pytest.mark.parametrize(
    "uri",
    [
        "batchplane://",
        "batchplane://root",
        "batchplane://planner/1",
        "batchplane://constructor/-1",
        "batchplane://constructor/x",
        "batchplane://loader/1/a/b",
        "batchplane://constructor/1/a",
        "https://planner",
        "batchplane://loader//x",
        "batchplane://trainer/1",
    ],
)
def test_a_malformed_identity_is_refused(uri: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_uri(uri)


def test_a_certificate_naming_two_identities_is_refused_and_one_naming_none_has_none() -> None:
    with pytest.raises(InvalidArgument, match="2 batchplane identities"):
        identity_of_names(["batchplane://constructor/0", "batchplane://planner"])
    assert identity_of_names(["planner.batchplane", "spiffe://cluster/ns/x"]) is None


def test_every_rpc_of_the_contract_has_a_rule() -> None:
    assert sorted(m for m in METHODS if m not in RULES) == []
    assert all(RULES[m].roles <= set(ROLES) for m in RULES)


def _request(method: str, index: int, replica: str = "") -> object:
    name = method.rsplit("/", 1)[-1]
    service = method.split("/")[1].rsplit(".", 1)[-1]
    module = {"Planner": planner_pb2, "Loader": loader_pb2, "Constructor": constructor_pb2}[service]
    cls = getattr(module, f"{name}Request", None)
    if cls is None:
        return None
    fields = cls.DESCRIPTOR.fields_by_name
    values = {"loader_index": index, "constructor_index": index}
    kwargs = {k: v for k, v in values.items() if k in fields}
    if "replica" in fields:
        kwargs["replica"] = replica
    return cls(**kwargs)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("role", ROLES)
def test_each_role_may_make_only_its_own_calls(method: str, role: str) -> None:
    identity = Identity(role)
    request = _request(method, 0)
    if role in RULES[method].roles:
        authorize(identity, method, request)
    else:
        with pytest.raises(PermissionDenied, match=f"batchplane://{role} may not call"):
            authorize(identity, method, request)


@given(st.integers(0, 1000), st.integers(0, 1000))
def test_a_constructor_acts_only_for_its_own_index(own: int, other: int) -> None:
    identity = Identity("constructor", own)
    for method in ("/batchplane.v1.Planner/GetPlan", "/batchplane.v1.Planner/RegisterConstructor", "/batchplane.v1.Loader/FetchSamples"):
        if own == other:
            authorize(identity, method, _request(method, other))
        else:
            with pytest.raises(PermissionDenied, match="only for itself"):
                authorize(identity, method, _request(method, other))
    authorize(Identity("constructor"), "/batchplane.v1.Planner/GetPlan", _request("/batchplane.v1.Planner/GetPlan", other))


@given(st.integers(0, 50), st.text(max_size=12), st.integers(0, 50), st.text(max_size=12))
def test_a_loader_registers_and_leaves_only_as_its_own_replica(own: int, own_replica: str, index: int, replica: str) -> None:
    identity = Identity("loader", own, own_replica or None)
    same = index == own and (not own_replica or (replica or str(index)) == own_replica)
    for method in ("/batchplane.v1.Planner/RegisterLoader", "/batchplane.v1.Planner/DeregisterLoader"):
        request = _request(method, index, replica)
        if same:
            authorize(identity, method, request)
        else:
            with pytest.raises(PermissionDenied):
                authorize(identity, method, request)


def test_an_unknown_method_is_refused_whoever_asks() -> None:
    for role in ROLES:
        with pytest.raises(PermissionDenied):
            authorize(Identity(role), "/batchplane.v1.Planner/DropLedger")


def test_a_refusal_names_the_caller_not_the_part_it_acted_for() -> None:
    with pytest.raises(PermissionDenied) as info:
        authorize(
            Identity("loader", 1, "secret-replica-7"),
            "/batchplane.v1.Planner/DeregisterLoader",
            _request("/batchplane.v1.Planner/DeregisterLoader", 1, "victim-3"),
        )
    assert "victim-3" not in str(info.value)


def test_servers_are_checked_by_a_name_per_role() -> None:
    assert [server_name(r) for r in CERTIFIED_ROLES] == [
        "planner.batchplane",
        "loader.batchplane",
        "constructor.batchplane",
        "operator.batchplane",
    ]
    with pytest.raises(InvalidArgument):
        server_name("trainer")


def test_role_token_verifiers_are_read_as_digests_and_malformed_ones_are_refused(tmp_path) -> None:
    """Issue 41, point 2: a server holds verifiers (SHA-256 digests), never another role's token:
    `<role>.sha256` holds the digest, `<role>` a token hashed as read; a verifier that is no
    SHA-256 in hex, or a folder with no role's file, is refused naming --auth-tokens."""
    import hashlib

    import pytest

    from batchplane.core.errors import ConfigError
    from batchplane.core.tls import read_role_verifiers

    (tmp_path / "planner.sha256").write_text(hashlib.sha256(b"p").hexdigest())
    (tmp_path / "loader").write_text("l\n")
    (tmp_path / "unrelated").write_text("x")
    assert read_role_verifiers(tmp_path) == {"planner": hashlib.sha256(b"p").digest(), "loader": hashlib.sha256(b"l").digest()}
    (tmp_path / "operator.sha256").write_text("not-hex")
    with pytest.raises(ConfigError, match=r"--auth-tokens: .*operator.sha256 must hold a SHA-256 in hex"):
        read_role_verifiers(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"--auth-tokens: holds none of the role files"):
        read_role_verifiers(empty)
