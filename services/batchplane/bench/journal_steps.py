"""The synthetic workload of `batchplane bench journal`: where a point's store lies (`Place`, which
a producer process can open again), synthetic TGBs and their objects, and a manifest pre-grown
to stand in for hours of commits."""

from __future__ import annotations

import dataclasses
import os
import time
import zlib

import numpy as np

from batchplane.core.object_storage import open_storage
from batchplane.core.storage import Storage
from batchplane.journal import tgb
from batchplane.journal.commit import ManifestSettings, version_key
from batchplane.journal.manifest import (
    Commit,
    ManifestState,
    Register,
    StepEntry,
    StepObject,
    VersionRecord,
    apply,
    encode_record,
)


@dataclasses.dataclass(frozen=True)
class Place:
    """A point's store, as another process opens it.

    Attributes:
        location: A local folder or an object-store URL (`open_storage`).
        environ: Environment variables the opener needs (the AWS ones of moto's server).
    """

    location: str
    environ: dict[str, str] = dataclasses.field(default_factory=dict)

    def open(self) -> Storage:
        """Opens the store (setting `environ` in this process first: obstore reads it)."""
        os.environ.update(self.environ)
        return open_storage(self.location)


def synthetic_tgb(step: int, *, world: int, slice_bytes: int, cp: int = 1, fill: np.ndarray) -> bytearray:
    """A synthetic TGB of world / cp x cp slices of `slice_bytes` each (views of `fill`)."""
    dp = world // cp
    slices = {(d, c): {"payload": fill[((d * cp + c) * 4096) % 65536 :][:slice_bytes]} for d in range(dp) for c in range(cp)}
    return tgb.encode_tgb(slices, step=step, dp=dp, cp=cp)


def fill(nbytes: int, seed: int) -> np.ndarray:
    """Random bytes that TGB slices are cut from: `nbytes` and 64 KiB more."""
    return np.random.default_rng(seed).integers(0, 256, nbytes + 65536, dtype=np.uint8)


def step_key(step: int) -> str:
    """The key of a step's object: `tgb/<step>.tgb`."""
    return f"tgb/{step:012d}.tgb"


def write_step(storage: Storage, step: int, data: bytearray) -> StepEntry:
    """Writes a step's object (`step_key`); returns its manifest entry."""
    key = step_key(step)
    storage.put_if_absent(key, data)
    return StepEntry(step, (StepObject(key, len(data), f"crc32:{zlib.crc32(data):08x}"),))


def pregrow(storage: Storage, steps: int, settings: ManifestSettings, *, tgb_bytes: int) -> int:
    """Writes one checkpoint version listing `steps` committed steps (objects not written);
    returns its version (0 without steps)."""
    if steps == 0:
        return 0
    state = apply(ManifestState(), Register("pregrown"))
    entries = tuple(StepEntry(s, (StepObject(step_key(s), tgb_bytes, "crc32:00000000"),)) for s in range(steps))
    state = apply(state, Commit("pregrown", 1, entries))
    k = settings.checkpoint_every
    version = k * -(-3 // k)  # the first checkpoint version above the two changes it stands for
    state = dataclasses.replace(state, version=version)
    record = VersionRecord(version=version, change=Register("pregrown"), written_at_s=time.time(), state=state)
    storage.put_if_absent(version_key(version), encode_record(record))
    return version
