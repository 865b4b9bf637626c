"""Synthetic multi-source Parquet dataset for the demo and the tests (not real training data).

`write_demo_dataset` writes one directory per source, ``root/<name>/part-00000.parquet``,
``part-00001.parquet``, ..., each file with several row groups, compressed with zstd and with
page checksums. A text source (`DemoSource`) has the schema

    input_ids: list<int32>   token ids in [0, vocab_size)
    doc_id:    int64         the row's global index over the source's files in sorted file order

and an image-text source (`ImageTextSource`) the schema of `batchplane.demo.images.SCHEMA`
(caption token ids, JPEG images, doc_id), read through the `image_text` transform.

The four default text sources (`DEMO_SOURCES`) have distinct, skewed length distributions
(short captions with a long tail, long documents, heavy-tailed code, bimodal chat), declared as
mixtures of `LogNormal` and `Pareto` components, so that packing and balancing have something
to do. Token ids follow a sparse order-1 Markov chain per source, so a tiny language model's
loss visibly falls when trained on them. The fifth default source, "images", carries 0-4 JPEG
images per sample at mixed resolutions, so its transform costs far more per sample.

Everything is derived from ``seed`` and the source name (through `zlib.crc32`, never the
salted built-in `hash`), so the same arguments write byte-identical files with the same
numpy, Pillow and pyarrow versions. The whole default dataset (25 thousand rows) writes in a few
seconds.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import zlib
from collections.abc import Callable, Sequence
from typing import Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchplane.demo.images import write_image_text_source

__all__ = [
    "DEMO_SOURCES",
    "SCHEMA",
    "DemoSource",
    "ImageTextSource",
    "LengthComponent",
    "LogNormal",
    "Pareto",
    "sample_lengths",
    "write_demo_dataset",
]

#: The Arrow schema of every file written here.
SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32())), ("doc_id", pa.int64())])

# Sub-streams derived from (seed, crc32(name)); fixed so that adding one never shifts another.
_STREAM_TABLE = 0
_STREAM_LENGTHS = 1
_STREAM_TOKENS = 2


@dataclasses.dataclass(frozen=True)
class LogNormal:
    """Lengths ``median * exp(sigma * N(0, 1))``, one component of a length mixture."""

    #: Median length in tokens, before clipping.
    median: float
    #: Standard deviation of the log length.
    sigma: float
    #: Relative weight in the mixture (normalized over the source's components).
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0 and self.weight > 0):
            raise ValueError(f"LogNormal needs median > 0, sigma >= 0, weight > 0; got {self}")

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Draws `n` real-valued lengths.

        Args:
            n: Number of lengths.
            rng: Random generator to draw from.

        Returns:
            float64 array of shape ``(n,)``.
        """
        return self.median * np.exp(self.sigma * rng.standard_normal(n))


@dataclasses.dataclass(frozen=True)
class Pareto:
    """Lengths ``minimum * (1 + Lomax(alpha))``: Pareto with scale `minimum`, heavy-tailed."""

    #: Smallest length in tokens (the Pareto scale).
    minimum: float
    #: Tail index; smaller is heavier (``P(X > x) = (minimum / x) ** alpha``).
    alpha: float
    #: Relative weight in the mixture (normalized over the source's components).
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not (self.minimum > 0 and self.alpha > 0 and self.weight > 0):
            raise ValueError(f"Pareto needs minimum > 0, alpha > 0, weight > 0; got {self}")

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Draws `n` real-valued lengths.

        Args:
            n: Number of lengths.
            rng: Random generator to draw from.

        Returns:
            float64 array of shape ``(n,)``.
        """
        return self.minimum * (1.0 + rng.pareto(self.alpha, n))


LengthComponent = Union[LogNormal, Pareto]


def _layout_problems(name: str, num_rows: int, files: int, rows_per_row_group: int) -> list[str]:
    """What is wrong with a source's name and file layout (empty when nothing)."""
    problems = []
    if not name or "/" in name or name.startswith("."):
        problems.append(f"name must be a plain directory name, got {name!r}")
    if num_rows < 1:
        problems.append(f"num_rows must be >= 1, got {num_rows}")
    if not 1 <= files <= max(num_rows, 1):
        problems.append(f"files must be in [1, num_rows], got {files}")
    if rows_per_row_group < 1:
        problems.append(f"rows_per_row_group must be >= 1, got {rows_per_row_group}")
    return problems


@dataclasses.dataclass(frozen=True)
class ImageTextSource:
    """One synthetic image-text source, written by `batchplane.demo.images`."""

    #: Directory name under the dataset root; also seeds the source's random streams.
    name: str
    #: One line, shown by the demo.
    description: str
    #: Total rows over all files.
    num_rows: int
    #: Number of Parquet files the rows are split over (as evenly as possible).
    files: int
    #: Rows per Parquet row group (the last group of a file may be smaller).
    rows_per_row_group: int

    def __post_init__(self) -> None:
        problems = _layout_problems(self.name, self.num_rows, self.files, self.rows_per_row_group)
        if problems:
            raise ValueError(f"ImageTextSource {self.name!r}: " + "; ".join(problems))


@dataclasses.dataclass(frozen=True)
class DemoSource:
    """One synthetic source: how many rows, how they are laid out, and how they look."""

    #: Directory name under the dataset root; also seeds the source's random streams.
    name: str
    #: One line, shown by the demo.
    description: str
    #: Total rows over all files.
    num_rows: int
    #: Number of Parquet files the rows are split over (as evenly as possible).
    files: int
    #: Rows per Parquet row group (the last group of a file may be smaller).
    rows_per_row_group: int
    #: Mixture components of the length distribution, in tokens.
    lengths: tuple[LengthComponent, ...]
    #: Lengths are rounded and clipped to ``[min_length, max_length]``.
    min_length: int = 2
    max_length: int = 2048
    #: Successors per token in the source's Markov chain; the k-th is taken with weight 1/(k+1).
    branching: int = 4
    #: Probability that a token ignores the chain and is uniform over the vocabulary.
    noise: float = 0.05

    def __post_init__(self) -> None:
        problems = _layout_problems(self.name, self.num_rows, self.files, self.rows_per_row_group)
        if not self.lengths:
            problems.append("lengths needs at least one component")
        if not 2 <= self.min_length <= self.max_length:
            problems.append(f"need 2 <= min_length <= max_length, got {self.min_length}, {self.max_length}")
        if self.branching < 1:
            problems.append(f"branching must be >= 1, got {self.branching}")
        if not 0.0 <= self.noise <= 1.0:
            problems.append(f"noise must be in [0, 1], got {self.noise}")
        if problems:
            raise ValueError(f"DemoSource {self.name!r}: " + "; ".join(problems))


#: The default sources: four text sources (23 thousand rows, 5.5 million tokens) and one
#: image-text source (2 thousand rows, about 0.5 million tokens once its images are patchified).
DEMO_SOURCES: tuple[DemoSource | ImageTextSource, ...] = (
    DemoSource(
        name="captions",
        description="short image captions: ~98% under 64 tokens, a long tail up to 1024",
        num_rows=10_000,
        files=3,
        rows_per_row_group=1000,
        lengths=(
            LogNormal(median=18, sigma=0.45, weight=0.984),
            Pareto(minimum=64, alpha=0.9, weight=0.016),
        ),
        min_length=2,
        max_length=1024,
        branching=3,
    ),
    DemoSource(
        name="docs",
        description="long web documents: lognormal, median ~768 tokens, clipped to [64, 2048]",
        num_rows=3_000,
        files=2,
        rows_per_row_group=500,
        lengths=(LogNormal(median=768, sigma=0.55),),
        min_length=64,
        max_length=2048,
        branching=6,
    ),
    DemoSource(
        name="code",
        description="source files: Pareto from ~100 tokens (alpha 1.1), clipped at 2048",
        num_rows=4_000,
        files=2,
        rows_per_row_group=500,
        lengths=(Pareto(minimum=100, alpha=1.1),),
        min_length=16,
        max_length=2048,
        branching=2,
    ),
    DemoSource(
        name="chat",
        description="chat: bimodal, short turns (~32 tokens) and medium conversations (~384)",
        num_rows=6_000,
        files=3,
        rows_per_row_group=1000,
        lengths=(
            LogNormal(median=32, sigma=0.6, weight=0.6),
            LogNormal(median=384, sigma=0.45, weight=0.4),
        ),
        min_length=4,
        max_length=1536,
        branching=4,
    ),
    ImageTextSource(
        name="images",
        description="image-text pairs: 0-4 JPEGs (mostly one, 64x64 to 512x336) and an 8-48 token caption",
        num_rows=2_000,
        files=2,
        rows_per_row_group=250,
    ),
)


def _rng(seed: int, name: str, stream: int) -> np.random.Generator:
    """A generator for one (seed, source, purpose) triple, stable across processes."""
    return np.random.default_rng([seed, zlib.crc32(name.encode("utf-8")), stream])


def sample_lengths(source: DemoSource, n: int, rng: np.random.Generator) -> np.ndarray:
    """Draws sample lengths from the source's mixture, rounded and clipped to its range.

    Args:
        source: The source whose length distribution to draw from.
        n: Number of lengths to draw (>= 0).
        rng: Random generator to draw from.

    Returns:
        int64 array of shape ``(n,)`` with lengths in tokens, all in
        ``[source.min_length, source.max_length]`` (so >= 2).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    weights = np.array([c.weight for c in source.lengths], dtype=np.float64)
    which = rng.choice(len(source.lengths), size=n, p=weights / weights.sum())
    raw = np.empty(n, dtype=np.float64)
    for i, component in enumerate(source.lengths):
        mask = which == i
        raw[mask] = component.draw(int(mask.sum()), rng)
    # Clip before casting: Pareto draws can overflow int64.
    raw = np.clip(np.rint(raw), source.min_length, source.max_length)
    return raw.astype(np.int64)


def _transition(source: DemoSource, *, vocab_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The source's Markov chain: successor table ``(vocab, branching)`` and its CDF."""
    rng = _rng(seed, source.name, _STREAM_TABLE)
    successors = rng.integers(0, vocab_size, size=(vocab_size, source.branching), dtype=np.int64)
    weights = 1.0 / np.arange(1, source.branching + 1, dtype=np.float64)
    cdf = np.cumsum(weights / weights.sum())
    cdf[-1] = 1.0
    return successors, cdf


def _generate_tokens(
    lengths: np.ndarray,
    *,
    successors: np.ndarray,
    cdf: np.ndarray,
    noise: float,
    vocab_size: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """Token ids of all rows, concatenated in row order.

    Runs the chain for all rows at once, one position at a time. Rows are sorted longest first
    so the rows still active at position t are a prefix; the random draws are laid out
    position-major in the same order, so the draws for position t are one contiguous slice.
    """
    total = int(lengths.sum())
    order = np.argsort(-lengths, kind="stable")
    sorted_lengths = lengths[order]
    width = int(sorted_lengths[0])
    # active[t]: rows with length > t; offsets[t]: start of position t's draws.
    active = np.searchsorted(-sorted_lengths, -np.arange(width), side="left")
    offsets = np.concatenate(([0], np.cumsum(active)))
    uniform = rng.integers(0, vocab_size, size=total, dtype=np.int64)
    choice = np.searchsorted(cdf, rng.random(total), side="right")
    use_noise = rng.random(total) < noise

    grid = np.zeros((width, len(lengths)), dtype=np.int64)
    grid[0, : active[0]] = uniform[: active[0]]
    for t in range(1, width):
        k = int(active[t])
        draws = slice(int(offsets[t]), int(offsets[t]) + k)
        step = successors[grid[t - 1, :k], choice[draws]]
        grid[t, :k] = np.where(use_noise[draws], uniform[draws], step)

    rows = np.empty_like(grid.T)
    rows[order] = grid.T
    mask = np.arange(width)[None, :] < lengths[:, None]
    return rows[mask].astype(np.int32)


def _file_bounds(num_rows: int, files: int) -> list[tuple[int, int]]:
    """Half-open global row ranges of each file, as even as possible, earlier files larger."""
    base, extra = divmod(num_rows, files)
    bounds, start = [], 0
    for i in range(files):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def write_demo_dataset(
    root: pathlib.Path,
    *,
    sources: Sequence[DemoSource | ImageTextSource] = DEMO_SOURCES,
    vocab_size: int = 1024,
    seed: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, pathlib.Path]:
    """Writes each source as Parquet files under ``root/<name>/``.

    Files are named ``part-00000.parquet``, ``part-00001.parquet``, ... and written through a
    temporary name, then renamed, so a reader never sees a half-written file. Existing files of
    the same names are overwritten; other files in the directories are left alone (making the
    result idempotent, e.g. removing stale parts after shrinking ``files``, is the caller's
    business).

    Args:
        root: Dataset root; created if missing.
        sources: Sources to write; names must be unique.
        vocab_size: Token ids are in ``[0, vocab_size)``; at least 2, at most 2**31 (at least 3
            with an image-text source, whose captions leave the last id to the image token).
        seed: Seed of every random draw (together with each source's name).
        progress: Called as ``progress(source_name, rows_written, rows_total)`` after each row
            group is written.

    Returns:
        ``{source name: its directory}`` in the order of `sources`.
    """
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"source names must be unique, got {names}")
    if not 2 <= vocab_size <= 2**31:
        raise ValueError(f"vocab_size must be in [2, 2**31], got {vocab_size}")
    root = pathlib.Path(root)
    directories: dict[str, pathlib.Path] = {}
    for source in sources:
        directory = root / source.name
        directory.mkdir(parents=True, exist_ok=True)
        if isinstance(source, ImageTextSource):
            _write_image_source(source, directory, vocab_size=vocab_size, seed=seed, progress=progress)
        else:
            _write_source(source, directory, vocab_size=vocab_size, seed=seed, progress=progress)
        directories[source.name] = directory
    return directories


def _write_image_source(
    source: ImageTextSource,
    directory: pathlib.Path,
    *,
    vocab_size: int,
    seed: int,
    progress: Callable[[str, int, int], None] | None,
) -> None:
    """Writes one image-text source's files into `directory`."""
    write_image_text_source(
        directory,
        rows=source.num_rows,
        # One seed per (seed, name), so two image sources differ.
        seed=int(np.random.SeedSequence([seed, zlib.crc32(source.name.encode("utf-8"))]).generate_state(1)[0]),
        files=source.files,
        row_group_rows=source.rows_per_row_group,
        vocab_size=vocab_size,
        progress=None if progress is None else lambda rows, total: progress(source.name, rows, total),
    )


def _write_source(
    source: DemoSource,
    directory: pathlib.Path,
    *,
    vocab_size: int,
    seed: int,
    progress: Callable[[str, int, int], None] | None,
) -> None:
    """Writes one source's files into `directory`."""
    lengths = sample_lengths(source, source.num_rows, _rng(seed, source.name, _STREAM_LENGTHS))
    successors, cdf = _transition(source, vocab_size=vocab_size, seed=seed)
    token_rng = _rng(seed, source.name, _STREAM_TOKENS)
    written = 0
    for index, (start, stop) in enumerate(_file_bounds(source.num_rows, source.files)):
        path = directory / f"part-{index:05d}.parquet"
        tmp = directory / f".{path.name}.tmp"
        with pq.ParquetWriter(
            tmp,
            SCHEMA,
            compression="zstd",
            write_page_checksum=True,
            write_statistics=True,
        ) as writer:
            for group_start in range(start, stop, source.rows_per_row_group):
                group_stop = min(group_start + source.rows_per_row_group, stop)
                group_lengths = lengths[group_start:group_stop]
                tokens = _generate_tokens(
                    group_lengths,
                    successors=successors,
                    cdf=cdf,
                    noise=source.noise,
                    vocab_size=vocab_size,
                    rng=token_rng,
                )
                offsets = np.zeros(len(group_lengths) + 1, dtype=np.int32)
                np.cumsum(group_lengths, out=offsets[1:])
                input_ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens))
                doc_id = pa.array(np.arange(group_start, group_stop, dtype=np.int64))
                writer.write_table(
                    pa.Table.from_arrays([input_ids, doc_id], schema=SCHEMA),
                    row_group_size=len(group_lengths),
                )
                written += len(group_lengths)
                if progress is not None:
                    progress(source.name, written, source.num_rows)
        os.replace(tmp, path)
