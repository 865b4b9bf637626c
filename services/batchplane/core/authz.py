"""Which role may make which call, and for whom: the one table every server's interceptor
(core.rpc) checks each RPC against. Pure: no grpc, no files.

A caller acts for its own index only: a constructor asks for its own plans and samples, a loader
registers and leaves as its own replica. An identity that names no index (a certificate per
component, as the Helm chart issues) may act for any index of its role; one naming an index (as
`batchplane up` issues) only for that one. The health service answers every authenticated
caller; a method missing from the table is refused (fail closed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from batchplane.core.errors import PermissionDenied
from batchplane.core.identity import Identity

#: A request -> the (index, replica) it acts for (replica None: the request names none).
ActsFor = Callable[[Any], tuple[int, str | None]]


@dataclasses.dataclass(frozen=True)
class Rule:
    """Who may call one method.

    Attributes:
        roles: The roles allowed.
        acts_for: Where the request names the index (and replica) it acts for; None: it names none.
    """

    roles: frozenset[str]
    acts_for: ActsFor | None = None


def _rule(*roles: str, acts_for: ActsFor | None = None) -> Rule:
    return Rule(frozenset(roles), acts_for)


def _loader(request: Any) -> tuple[int, str | None]:
    return request.loader_index, request.replica or str(request.loader_index)


def _constructor(request: Any) -> tuple[int, str | None]:
    return request.constructor_index, None


_HEALTH = _rule("planner", "loader", "constructor", "operator", "trainer")

#: Full method name -> who may call it.
RULES: dict[str, Rule] = {
    "/batchplane.v1.Planner/RegisterLoader": _rule("loader", acts_for=_loader),
    "/batchplane.v1.Planner/DeregisterLoader": _rule("loader", acts_for=_loader),
    "/batchplane.v1.Planner/RegisterConstructor": _rule("constructor", acts_for=_constructor),
    "/batchplane.v1.Planner/GetJob": _rule("loader", "constructor", "operator"),
    "/batchplane.v1.Planner/GetPlan": _rule("constructor", acts_for=_constructor),
    "/batchplane.v1.Planner/GetStatus": _rule("operator"),
    "/batchplane.v1.Planner/Report": _rule("constructor"),
    "/batchplane.v1.Loader/GetSummary": _rule("planner"),
    "/batchplane.v1.Loader/FetchSamples": _rule("constructor", acts_for=_constructor),
    "/batchplane.v1.Constructor/GetInfo": _rule("trainer"),
    "/batchplane.v1.Constructor/GetBatch": _rule("trainer"),
    "/batchplane.v1.Constructor/Report": _rule("trainer"),
    "/batchplane.v1.Constructor/GetLength": _rule("trainer"),
    "/batchplane.v1.Constructor/MarkCheckpoint": _rule("trainer"),
    "/batchplane.v1.Constructor/NoteWait": _rule("trainer"),
    "/grpc.health.v1.Health/Check": _HEALTH,
    "/grpc.health.v1.Health/Watch": _HEALTH,
}


def needs_request(method: str) -> bool:
    """True when authorizing `method` needs its request (it names the index it acts for)."""
    rule = RULES.get(method)
    return rule is not None and rule.acts_for is not None


def authorize(identity: Identity, method: str, request: Any = None) -> None:
    """Checks that `identity` may call `method` with `request`.

    Raises:
        PermissionDenied: another role's method, a method not in RULES, or a request acting for
            another index or replica than the identity's own. The message names the caller's
            identity and the method, never another part's id.
    """
    rule = RULES.get(method)
    if rule is None or identity.role not in rule.roles:
        raise PermissionDenied(f"{identity} may not call {method}")
    if rule.acts_for is None or identity.index is None:
        return
    index, replica = rule.acts_for(request)
    if index != identity.index or (identity.replica is not None and replica != identity.replica):
        raise PermissionDenied(f"{identity} may call {method} only for itself")
