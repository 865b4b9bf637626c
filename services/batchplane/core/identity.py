"""Who a caller is: a role of the job and, for loaders and constructors, the index (and a
loader's replica id) it acts for. Pure: no grpc, no files.

An identity travels in a certificate as a URI subject alternative name:

    batchplane://planner                  batchplane://operator
    batchplane://constructor              any constructor index (one certificate per component)
    batchplane://constructor/3            constructor 3 only
    batchplane://loader/1                 any replica of loader group 1
    batchplane://loader/1/loader-1-abc    that replica only (the id percent-encoded)

and every certificate also names `<role>.batchplane` as a DNS name: a caller checks the server
it dials by that name (`server_name`), so a constructor dialing a loader reaches a loader and
nothing that merely holds some certificate of the job's CA.

Inside a pod the trainer reaches its constructor over a Unix socket with local credentials; its
identity is the role "trainer", given by the transport (never by a certificate).
"""

from __future__ import annotations

import dataclasses
import hashlib
import urllib.parse

from batchplane.core.errors import InvalidArgument

SCHEME = "batchplane"
#: Roles of the parts that hold certificates, and the trainer (by local transport only).
CERTIFIED_ROLES = ("planner", "loader", "constructor", "operator")
#: The file (and Secret key) name suffix of a role token's verifier, `<role>.sha256`: the token's
#: SHA-256 in hex, which a server holds instead of the token (`core.tls.read_role_verifiers`).
VERIFIER_SUFFIX = ".sha256"


def token_verifier(token: str) -> bytes:
    """What a server keeps of a bearer token: its SHA-256 (compared in constant time)."""
    return hashlib.sha256(token.encode()).digest()


TRAINER = "trainer"
ROLES = (*CERTIFIED_ROLES, TRAINER)
#: Roles whose identity may name an index (and, for loaders, a replica id).
INDEXED_ROLES = ("loader", "constructor")
#: The DNS zone of the names servers are checked by.
DNS_ZONE = "batchplane"


@dataclasses.dataclass(frozen=True)
class Identity:
    """A caller.

    Attributes:
        role: One of ROLES.
        index: The loader group or constructor index it acts for; None: any (a certificate per
            component, or a role without indices).
        replica: A loader's replica id; None: any replica of its group.
    """

    role: str
    index: int | None = None
    replica: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidArgument(f"unknown role {self.role!r}; roles are {', '.join(ROLES)}")
        if (self.index is not None or self.replica is not None) and self.role not in INDEXED_ROLES:
            raise InvalidArgument(f"a {self.role} identity names no index or replica")
        if self.replica is not None and (self.role != "loader" or self.index is None):
            raise InvalidArgument("only a loader identity with an index names a replica")
        if self.index is not None and self.index < 0:
            raise InvalidArgument(f"an identity's index must be >= 0, got {self.index}")

    def uri(self) -> str:
        """The URI subject alternative name carrying this identity."""
        parts = [self.role]
        if self.index is not None:
            parts.append(str(self.index))
        if self.replica is not None:
            parts.append(urllib.parse.quote(self.replica, safe=""))
        return f"{SCHEME}://" + "/".join(parts)

    def __str__(self) -> str:
        return self.uri()


def parse_uri(uri: str) -> Identity:
    """The identity a `batchplane://` URI names.

    Raises:
        InvalidArgument: not such a URI, an unknown role, a bad index.
    """
    head = f"{SCHEME}://"
    if not uri.startswith(head):
        raise InvalidArgument(f"not a {head} identity: {uri!r}")
    parts = uri[len(head) :].split("/")
    if not 1 <= len(parts) <= 3 or any(not p for p in parts):
        raise InvalidArgument(f"a {head} identity is {head}<role>[/<index>[/<replica>]], got {uri!r}")
    index = None
    if len(parts) > 1:
        if not parts[1].isdigit() or len(parts[1]) > 9:
            raise InvalidArgument(f"the index of identity {uri!r} must be a number")
        index = int(parts[1])
    replica = urllib.parse.unquote(parts[2]) if len(parts) > 2 else None
    return Identity(parts[0], index, replica)


def identity_of_names(uris: list[str]) -> Identity | None:
    """The identity among a certificate's URI names: None when it names none; an error when it
    names more than one (a certificate acting for two parts is refused, not guessed at).

    Raises:
        InvalidArgument: two identities, or one that does not parse.
    """
    ours = [u for u in uris if u.startswith(f"{SCHEME}://")]
    if len(ours) > 1:
        raise InvalidArgument(f"a certificate names {len(ours)} batchplane identities; one is allowed")
    return parse_uri(ours[0]) if ours else None


def server_name(role: str) -> str:
    """The DNS name a server of `role` is checked by, e.g. "loader.batchplane"."""
    if role not in CERTIFIED_ROLES:
        raise InvalidArgument(f"no server name for role {role!r}")
    return f"{role}.{DNS_ZONE}"
