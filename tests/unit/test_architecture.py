"""The dependency rules of DESIGN.md, checked on the source: the client never imports service
code; services never import torch and do not import each other; pure logic imports no grpc and
does no I/O; the wire layer needs only numpy and protobuf."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROOTS = {"services": ROOT / "services", "client": ROOT / "client", "proto": ROOT / "proto"}
STDLIB = set(sys.stdlib_module_names)


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    out = {}
    for path in root.rglob("*.py"):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")) or path.parent == root:
            continue
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(p for p in parts if p != "__init__")] = path
    return out


ALL = {name: path for root in ROOTS.values() for name, path in modules(root).items()}


def imports_of(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def owned_by(prefix: str) -> list[str]:
    return sorted(m for m in ALL if m == prefix or m.startswith(prefix + "."))


def violations(module_names: list[str], forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for name in module_names:
        for imported in imports_of(ALL[name]):
            if any(imported == f or imported.startswith(f + ".") for f in forbidden):
                bad.append(f"{name} imports {imported}")
    return bad


SERVICES = ("batchplane.planner", "batchplane.loader", "batchplane.constructor")
SERVICE_SIDE = (
    *SERVICES,
    "batchplane.operator",
    "batchplane.core",
    "batchplane.launcher",
    "batchplane.demo",
    "batchplane.cli",
    "batchplane.journal",
)
PURE = (
    "batchplane.planner.mixture",
    "batchplane.planner.plan",
    "batchplane.planner.balance",
    "batchplane.planner.padded",
    "batchplane.planner.cost",
    "batchplane.planner.ledger",
    "batchplane.planner.membership",
    "batchplane.planner.models",
    "batchplane.planner.token_budget",
    "batchplane.planner.dgraph",
    "batchplane.planner.intervals",
    "batchplane.planner.lineage",
    "batchplane.core.schedule",
    "batchplane.planner.adaptive",
    "batchplane.planner.failover",
    "batchplane.planner.progress",
    "batchplane.planner.planning",
    "batchplane.planner.length",
    "batchplane.planner.source_changes",
    "batchplane.planner.digests",
    "batchplane.planner.fence_votes",
    "batchplane.constructor.progress",
    "batchplane.constructor.blocked",
    "batchplane.constructor.waits",
    "batchplane.constructor.build",
    "batchplane.constructor.releases",
    "batchplane.constructor.subbatch",
    "batchplane.operator.policy",
    "batchplane.operator.partition",
    "batchplane.operator.dataplane",
    "batchplane.operator.manifests",
    "batchplane.operator.reconcile",
    "batchplane.operator.podfields",
    "batchplane.operator.kube_types",
    "batchplane.core.pod_rank",
    "batchplane.operator.election",
    "batchplane.operator.events",
    "batchplane.core.logformat",
    "batchplane.core.routing",
    "batchplane.core.order",
    "batchplane.constructor.hooks",
    "batchplane.constructor.assemble",
    "batchplane.constructor.parallel",
    "batchplane.core.config",
    "batchplane.core.errors",
    "batchplane.core.identity",
    "batchplane.core.issuance",
    "batchplane.core.authz",
    "batchplane.core.mesh",
    "batchplane.core.delivery",
    "batchplane.core.lengths",
    "batchplane.core.store_errors",
    "batchplane.loader.locations",
    "batchplane.loader.file_facts",
    "batchplane.loader.bounds",
    "batchplane.loader.windows",
    "batchplane.constructor.bounds",
    "batchplane.constructor.checkpoint_marks",
    "batchplane.journal.manifest",
    "batchplane.journal.steplist",
    "batchplane.journal.policy",
    "batchplane.journal.tgb",
    "batchplane.journal.slices",
    "batchplane.journal.retention",
)


def test_the_module_table_found_the_packages() -> None:
    for prefix in (*SERVICE_SIDE, "batchplane.client", "batchplane.wire", *PURE):
        assert owned_by(prefix), prefix


@pytest.mark.parametrize("side", SERVICE_SIDE)
def test_service_side_never_imports_torch_or_the_client(side: str) -> None:
    assert violations(owned_by(side), ("torch", "batchplane.client", "batchplane.examples")) == []


@pytest.mark.parametrize("service", SERVICES)
def test_services_do_not_import_each_other(service: str) -> None:
    others = tuple(s for s in SERVICES if s != service)
    assert violations(owned_by(service), others) == []


def import_cycles(module_names: list[str]) -> list[list[str]]:
    """The cycles (strongly connected groups of 2 or more) of the import graph among
    `module_names`, counting imports inside functions too."""
    graph = {m: sorted(i for i in imports_of(ALL[m]) if i in module_names and i != m) for m in module_names}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for m in module_names:
        if m not in index:
            visit(m)
    return cycles


def test_service_modules_import_no_cycle() -> None:
    """A lazy import inside a function counts: it hides a cycle, it does not break it (issue 19:
    planner.adaptive <-> planner.schedule, planner.padded <-> planner.plan)."""
    service_side = sorted({m for side in SERVICE_SIDE for m in owned_by(side)})
    assert import_cycles(service_side) == []


def test_core_imports_no_service() -> None:
    assert violations(owned_by("batchplane.core"), (*SERVICES, "batchplane.launcher", "batchplane.demo")) == []


def test_the_journal_is_a_library_below_the_services() -> None:
    """The planner, producers and consumers use the journal; it uses only core."""
    assert (
        violations(owned_by("batchplane.journal"), (*SERVICES, "batchplane.operator", "batchplane.launcher", "batchplane.demo", "grpc"))
        == []
    )


def test_the_operator_drives_services_only_through_their_metrics_and_the_kubernetes_api() -> None:
    """It calls no service. It serves one gRPC service of its own, the certificate issuer
    (operator.issuer, tls.mode issued), which talks to no service either."""
    drivers = [m for m in owned_by("batchplane.operator") if m != "batchplane.operator.issuer"]
    assert violations(drivers, ("batchplane.loader", "batchplane.constructor", "batchplane.launcher", "grpc")) == []
    services = ("batchplane.loader", "batchplane.constructor", "batchplane.planner", "batchplane.launcher")
    stubs = tuple(f"batchplane.v1.{name}_pb2_grpc" for name in ("planner", "loader", "constructor"))
    assert violations(["batchplane.operator.issuer"], (*services, *stubs)) == []


# Each framework adapter of the client (a module, or a package and its modules) may import its
# own framework; no other client module may, so `import batchplane.client` needs none of them.
CLIENT_FRAMEWORKS = {
    "batchplane.client.hf": ("transformers", "accelerate"),
    "batchplane.client.hf_trainer": ("transformers", "accelerate"),
    "batchplane.client.lightning": ("lightning", "pytorch_lightning"),
    "batchplane.client.torchtitan": ("torchtitan", "torchdata"),
    # The colocated-DataLoader baseline of `bench delivery` reads Parquet as a user's would.
    "batchplane.examples.dataloader_rank": ("pyarrow",),
    # So does `bench vlm`'s (its image rows go through the transform as a pyarrow table, as in
    # batchplane's loader), padding tokens with the baseline above; the transform itself is
    # imported by name at run time, never statically.
    "batchplane.examples.vlm_rank": ("pyarrow", "batchplane.examples.dataloader_rank"),
}


def test_client_imports_only_torch_grpc_protobuf_numpy_and_the_contract() -> None:
    allowed_prefixes = (
        "torch",
        "grpc",
        "google.protobuf",
        "numpy",
        "batchplane.v1",
        "batchplane.wire",
        "batchplane.local_transport",
        "batchplane.client",
    )
    bad = []
    for name in owned_by("batchplane.client") + owned_by("batchplane.examples"):
        allowed = allowed_prefixes + sum((f for m, f in CLIENT_FRAMEWORKS.items() if name == m or name.startswith(m + ".")), ())
        for imported in imports_of(ALL[name]):
            top = imported.split(".")[0]
            if top in STDLIB or top == "__future__":
                continue
            if not any(imported == p or imported.startswith(p + ".") for p in allowed):
                bad.append(f"{name} imports {imported}")
    assert bad == []


@pytest.mark.parametrize("module", PURE)
def test_pure_logic_imports_no_grpc_and_no_io_libraries(module: str) -> None:
    assert violations([module], ("grpc", "pyarrow", "prometheus_client", "socket", "subprocess", "batchplane.v1")) == []


# Pure logic runs no threads and reads no clock (issue 19; STYLE.md: "no threads, clocks or
# sockets"): the driver owns them. These two still guard their state with a lock for the
# planner's gRPC threads; the table is exact, so it can only shrink.
THREADED_PURE = {
    "batchplane.planner.membership": ("threading",),  # Membership's lock
    "batchplane.core.order": ("threading",),  # SampleOrder's cache of windows
}
NO_THREADS_NO_CLOCKS = ("threading", "_thread", "concurrent", "multiprocessing", "asyncio", "queue", "time")


@pytest.mark.parametrize("module", PURE)
def test_pure_logic_runs_no_threads_and_reads_no_clock(module: str) -> None:
    allowed = THREADED_PURE.get(module, ())
    forbidden = tuple(f for f in NO_THREADS_NO_CLOCKS if f not in allowed)
    assert violations([module], forbidden) == []


@pytest.mark.parametrize("module", sorted(THREADED_PURE))
def test_the_threaded_pure_modules_table_is_exact(module: str) -> None:
    """A module that drops its lock leaves the table (and then the rule holds for it in full)."""
    assert module in PURE
    for allowed in THREADED_PURE[module]:
        assert violations([module], (allowed,)), f"{module} no longer imports {allowed}: remove it from THREADED_PURE"


def test_wire_needs_only_numpy_and_protobuf() -> None:
    bad = [
        i
        for i in imports_of(ALL["batchplane.wire"])
        if i.split(".")[0] not in STDLIB | {"__future__", "numpy"} and not i.startswith(("batchplane.v1", "google.protobuf"))
    ]
    assert bad == []


def test_service_processes_do_not_load_torch() -> None:
    """Loading every service module leaves torch out of the interpreter (it costs ~220 MB)."""
    code = (
        "import sys, batchplane.planner.server, batchplane.loader.server, batchplane.constructor.server, "
        "batchplane.launcher.local, batchplane.demo.run, batchplane.cli; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
