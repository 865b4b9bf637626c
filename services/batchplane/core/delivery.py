"""What each rank of the mesh receives: the bucket it consumes, whether it gets tensors, and
which variant of its bucket's microbatches (CP slice, pipeline-stage part). Pure; no I/O.

Shared by the planner (to tell loaders how many constructors fetch each bucket) and the
constructors (to build each variant once and hand it to every rank that wants it: TP peers
share one built batch, I3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from batchplane.core.mesh import ClientPlaceTree

#: Pipeline-stage roles: which part of a microbatch a stage gets.
ALL, FIRST, MIDDLE, LAST = "all", "first", "middle", "last"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way a bucket's microbatches are delivered; ranks with equal variants get the same
    bytes.

    Attributes:
        bucket: The bucket consumed (on the plan's axis).
        cp_rank: The CP slice to cut, or None for whole sequences (cp = 1, or axis "CP").
        stage: ALL, FIRST, MIDDLE or LAST.
        tensors: False when the rank gets no tensors at all (a TP peer the trainer broadcasts
            to, or a middle stage that needs nothing).
    """

    bucket: int
    cp_rank: int | None
    stage: str
    tensors: bool


@dataclasses.dataclass(frozen=True)
class DeliveryRules:
    """Delivery of one job.

    Args:
        mesh: The job's ClientPlaceTree.
        axis: The primary graph's axis, "DP" or "CP".
        broadcast: Dimensions the trainer broadcasts along ({"TP"}).
        middle_tensors: Tensors middle pipeline stages receive.
        pulling_ranks: Which ranks ask for batches (`constructors.pulling_ranks`): "all", or
            "megatron" (tensor-parallel rank 0 of the first and last pipeline stages).
    """

    mesh: ClientPlaceTree
    axis: str = "DP"
    broadcast: frozenset[str] = frozenset()
    middle_tensors: tuple[str, ...] = ()
    pulling_ranks: str = "all"

    def pulls(self, rank: int) -> bool:
        """Whether rank `rank` asks for its batches (the others are never waited for)."""
        if self.pulling_ranks == "all":
            return True
        c = self.mesh.coords(rank)
        return c.tp == 0 and c.pp in (0, self.mesh.sizes["pp"] - 1)

    def pulling(self, layout: Sequence[Sequence[int]]) -> list[int]:
        """The constructors with a rank that asks for batches.

        Args:
            layout: layout[c] = the ranks constructor c serves.
        """
        return [c for c, ranks in enumerate(layout) if any(self.pulls(r) for r in ranks)]

    def variant(self, rank: int) -> Variant:
        c = self.mesh.coords(rank)
        pp = self.mesh.sizes["pp"]
        stage = ALL if pp == 1 else FIRST if c.pp == 0 else LAST if c.pp == pp - 1 else MIDDLE
        cp_rank = c.cp if self.axis == "DP" and self.mesh.sizes["cp"] > 1 else None
        tensors = not ("TP" in self.broadcast and c.tp > 0) and not (stage == MIDDLE and not self.middle_tensors)
        return Variant(bucket=self.mesh.bucket_of(rank, self.axis), cp_rank=cp_rank, stage=stage, tensors=tensors)

    def needs_samples(self, ranks: Sequence[int]) -> set[int]:
        """Buckets whose samples `ranks` need fetched (some rank of them gets tensors)."""
        return {v.bucket for v in map(self.variant, ranks) if v.tensors}

    def fetchers(self, layout: Sequence[Sequence[int]]) -> list[int]:
        """For each bucket, how many constructors fetch its samples (a constructor none of whose
        ranks asks for batches builds nothing).

        Args:
            layout: layout[c] = the ranks constructor c serves.
        """
        counts = [0] * self.mesh.buckets(self.axis)
        for c in self.pulling(layout):
            for bucket in self.needs_samples(layout[c]):
                counts[bucket] += 1
        return counts

    def sample_fetchers(
        self,
        layout: Sequence[Sequence[int]],
        buckets: Sequence[np.ndarray],
        extra: Sequence[tuple[str, Sequence[np.ndarray]]],
        samples: int,
    ) -> np.ndarray:
        """How many constructors fetch each sample of a step, when some fetch samples besides
        their buckets' (a secondary graph that delivers payload columns: a rank encodes images
        of samples another replica trains). A constructor fetches each sample once.

        Args:
            layout: layout[c] = the ranks constructor c serves.
            buckets: buckets[b] = the step's sample indices bucket b (on this plan's axis) trains on.
            extra: Per delivering secondary graph, (its axis, its buckets' sample indices).
            samples: The step's sample count.
        Returns:
            int32 [samples]: constructors fetching each (0 for none).
        """
        counts = np.zeros(samples, np.int32)
        for c in self.pulling(layout):
            mine = np.zeros(samples, bool)
            for b in self.needs_samples(layout[c]):
                mine[buckets[b]] = True
            for axis, parts in extra:
                for b in {self.mesh.bucket_of(r, axis) for r in layout[c]}:
                    mine[parts[b]] = True
            counts += mine
        return counts
