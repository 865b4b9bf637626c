"""ClientPlaceTree: the trainer's device mesh as a tree of PP, DP, CP and TP. Pure; no I/O.

A job's world of `pp * dp * cp * tp` ranks is laid out by a rank order, fastest-varying axis
first. Megatron's order, the default, is "tp-cp-dp-pp": TP peers are neighbouring ranks (one
node), then CP, then DP, and pipeline stages are the slowest axis. Any permutation can be named.

The tree reads top-down PP -> DP -> CP -> TP: a pipeline stage holds data-parallel replicas, a
replica holds context-parallel slices, a slice is computed by a tensor-parallel group. Planning
distributes samples over the nodes of one level, the buckets of an axis:

- "DP": one bucket per data-parallel replica; all CP, TP and PP peers of a replica share it
  (CP peers get slices of its sequences, TP peers identical tensors, PP stages their part);
- "CP": one bucket per (DP, CP) pair, DP x CP uniform consumers of whole sequences (hybrid data
  parallelism, no sequence is sliced);
- "WORLD": one bucket per rank (e.g. a vision encoder run data-parallel over every GPU).

Coordinates of every rank are computed once with numpy, so building a tree for 10k+ ranks is
cheap, and `resize` rebuilds it when the mesh changes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

#: Mesh axes, top of the tree first.
AXES = ("pp", "dp", "cp", "tp")
#: Megatron-LM's rank order: tp varies fastest, pp slowest.
DEFAULT_ORDER = "tp-cp-dp-pp"
#: Distribution axes a strategy can name and the mesh axes one bucket spans.
DISTRIBUTION_AXES = ("DP", "CP", "WORLD")


class MeshError(ValueError):
    """A mesh that cannot exist (bad sizes, order, rank or axis); the message names the field."""


@dataclasses.dataclass(frozen=True)
class Coord:
    """Where one rank sits in the mesh."""

    rank: int
    pp: int
    dp: int
    cp: int
    tp: int


def parse_order(order: str) -> tuple[str, ...]:
    """The axes of a rank order such as "tp-cp-dp-pp", fastest first.

    Raises:
        MeshError: not a permutation of the four axes.
    """
    axes = tuple(part.strip().lower() for part in order.split("-"))
    if sorted(axes) != sorted(AXES):
        raise MeshError(f"mesh.order: must name each of {'-'.join(AXES)} once, fastest first (e.g. {DEFAULT_ORDER!r}); got {order!r}")
    return axes


class ClientPlaceTree:
    """The device mesh of a job.

    Args:
        pp, dp, cp, tp: Axis sizes, each >= 1.
        order: Rank order, fastest-varying axis first.
    Raises:
        MeshError: a size below 1 or a bad order.
    """

    def __init__(self, *, pp: int = 1, dp: int = 1, cp: int = 1, tp: int = 1, order: str = DEFAULT_ORDER) -> None:
        self.sizes: dict[str, int] = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        for axis, size in self.sizes.items():
            _check_size(axis, size)
        self.order = parse_order(order)
        self.world = pp * dp * cp * tp
        ranks = np.arange(self.world, dtype=np.int64)
        self._coords: dict[str, np.ndarray] = {}
        stride = 1
        for axis in self.order:
            self._coords[axis] = (ranks // stride) % self.sizes[axis]
            stride *= self.sizes[axis]
        # rank of every coordinate tuple, indexed [pp, dp, cp, tp]
        self._rank_of = np.zeros((pp, dp, cp, tp), dtype=np.int64)
        self._rank_of[self._coords["pp"], self._coords["dp"], self._coords["cp"], self._coords["tp"]] = ranks

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, pp: int = 1, cp: int = 1, tp: int = 1, order: str = DEFAULT_ORDER
    ) -> tuple[ClientPlaceTree, int]:
        """The mesh and this process's rank from torchrun's WORLD_SIZE and RANK plus the sizes
        of the model-parallel axes; dp is what remains.

        Raises:
            MeshError: WORLD_SIZE or RANK missing or not integers, WORLD_SIZE not divisible
                by pp * cp * tp, RANK not below WORLD_SIZE, or a bad size or order ("mesh.*").
        """
        for axis, size in (("pp", pp), ("cp", cp), ("tp", tp)):
            _check_size(axis, size)
        env = os.environ if env is None else env
        values = {}
        for name in ("WORLD_SIZE", "RANK"):
            text = env.get(name)
            if text is None or not text.strip().isdecimal():
                raise MeshError(f"{name}: must be set to an integer >= 0 (torchrun sets it), got {text!r}")
            values[name] = int(text)
        world, model = values["WORLD_SIZE"], pp * cp * tp
        if world < 1 or world % model:
            raise MeshError(f"WORLD_SIZE: {world} is not a positive multiple of pp*cp*tp = {pp}*{cp}*{tp} = {model}")
        if values["RANK"] >= world:
            raise MeshError(f"RANK: {values['RANK']} is not below WORLD_SIZE = {world}")
        return cls(pp=pp, dp=world // model, cp=cp, tp=tp, order=order), values["RANK"]

    def resize(self, **sizes: int) -> ClientPlaceTree:
        """A new tree with some axis sizes (or the order) changed."""
        merged: dict[str, Any] = {**self.sizes, "order": "-".join(self.order), **sizes}
        return ClientPlaceTree(**merged)

    # ---- coordinates ---------------------------------------------------------------------

    def coords(self, rank: int) -> Coord:
        """Where `rank` sits.

        Raises:
            MeshError: rank outside [0, world).
        """
        if not 0 <= rank < self.world:
            raise MeshError(f"rank: {rank} is outside the mesh of {self.world} ranks ({self.describe()})")
        return Coord(rank, *(int(self._coords[axis][rank]) for axis in AXES))

    def rank(self, *, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The rank at a coordinate."""
        for axis, value in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
            if not 0 <= value < self.sizes[axis]:
                raise MeshError(f"{axis}: {value} is outside [0, {self.sizes[axis]})")
        return int(self._rank_of[pp, dp, cp, tp])

    def ranks(self, **fixed: int) -> np.ndarray:
        """Ranks whose coordinates match `fixed` (e.g. dp=3), ascending (int64)."""
        mask = np.ones(self.world, dtype=bool)
        for axis, value in fixed.items():
            if axis not in self.sizes:
                raise MeshError(f"unknown mesh axis {axis!r}; axes are {AXES}")
            mask &= self._coords[axis] == value
        return np.flatnonzero(mask)

    # ---- distribution buckets ------------------------------------------------------------

    def buckets(self, axis: str) -> int:
        """Number of buckets a strategy distributes over on `axis` ("DP", "CP" or "WORLD")."""
        return {"DP": self.sizes["dp"], "CP": self.sizes["dp"] * self.sizes["cp"], "WORLD": self.world}[_axis(axis)]

    def bucket_of(self, rank: int, axis: str) -> int:
        """The bucket of `rank` on `axis`: its dp index ("DP"), dp * cp_size + cp ("CP"), or the
        rank itself ("WORLD")."""
        c = self.coords(rank)
        return {"DP": c.dp, "CP": c.dp * self.sizes["cp"] + c.cp, "WORLD": c.rank}[_axis(axis)]

    def bucket_ranks(self, axis: str, bucket: int) -> np.ndarray:
        """The ranks that consume bucket `bucket` of `axis`, ascending."""
        axis = _axis(axis)
        if not 0 <= bucket < self.buckets(axis):
            raise MeshError(f"bucket {bucket} is outside [0, {self.buckets(axis)}) on axis {axis}")
        if axis == "DP":
            return self.ranks(dp=bucket)
        if axis == "CP":
            return self.ranks(dp=bucket // self.sizes["cp"], cp=bucket % self.sizes["cp"])
        return np.array([bucket], dtype=np.int64)

    def describe(self) -> str:
        return f"pp={self.sizes['pp']} dp={self.sizes['dp']} cp={self.sizes['cp']} tp={self.sizes['tp']} order={'-'.join(self.order)}"

    def __repr__(self) -> str:
        return f"ClientPlaceTree({self.describe()})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClientPlaceTree) and self.sizes == other.sizes and self.order == other.order

    def __hash__(self) -> int:
        return hash((tuple(self.sizes.items()), self.order))


def _check_size(axis: str, size: object) -> None:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise MeshError(f"mesh.{axis}: must be an integer >= 1, got {size!r}")


def _axis(axis: str) -> str:
    if axis not in DISTRIBUTION_AXES:
        raise MeshError(f"axis: must be one of {DISTRIBUTION_AXES}, got {axis!r}")
    return axis
