"""Tests of the synthetic demo dataset writer (batchplane.demo.dataset)."""

from __future__ import annotations

import dataclasses
import math
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from batchplane.demo.dataset import (
    DEMO_SOURCES,
    DemoSource,
    LogNormal,
    sample_lengths,
    write_demo_dataset,
)

VOCAB = 256

#: The default sources, shrunk so a write takes well under a second.
SMALL_SOURCES: tuple[DemoSource, ...] = tuple(
    dataclasses.replace(source, num_rows=rows, rows_per_row_group=group)
    for source, rows, group in zip(
        DEMO_SOURCES,
        (900, 150, 300, 450),
        (100, 30, 60, 70),
    )
)


def _files(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(directory.glob("*.parquet"))


def _read_source(directory: pathlib.Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(path) for path in _files(directory))


def _lengths(table: pa.Table) -> np.ndarray:
    return pc.list_value_length(table["input_ids"]).to_numpy().astype(np.int64)


def _rows(table: pa.Table) -> list[np.ndarray]:
    column = table["input_ids"].combine_chunks()
    values = column.values.to_numpy()
    offsets = column.offsets.to_numpy()
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(column))]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("demo")
    return write_demo_dataset(root, sources=SMALL_SOURCES, vocab_size=VOCAB, seed=0)


def test_writes_named_directories_and_files(written: dict[str, pathlib.Path]) -> None:
    assert list(written) == [s.name for s in SMALL_SOURCES]
    for source in SMALL_SOURCES:
        directory = written[source.name]
        assert directory.name == source.name
        names = [path.name for path in _files(directory)]
        assert names == [f"part-{i:05d}.parquet" for i in range(source.files)]
        # No temporary files are left behind.
        assert sorted(p.name for p in directory.iterdir()) == names


def test_schema_compression_and_checksums(written: dict[str, pathlib.Path]) -> None:
    for source in SMALL_SOURCES:
        for path in _files(written[source.name]):
            parquet = pq.ParquetFile(path)
            schema = parquet.schema_arrow
            assert schema.names == ["input_ids", "doc_id"]
            assert schema.field("input_ids").type == pa.list_(pa.int32())
            assert schema.field("doc_id").type == pa.int64()
            metadata = parquet.metadata
            for group in range(metadata.num_row_groups):
                for column in range(metadata.num_columns):
                    assert metadata.row_group(group).column(column).compression == "ZSTD"
            # Reading with verification fails on a bad page checksum; it must succeed here.
            pq.read_table(path, page_checksum_verification=True)


def test_rows_split_over_files_and_row_groups(written: dict[str, pathlib.Path]) -> None:
    for source in SMALL_SOURCES:
        files = _files(written[source.name])
        rows = [pq.ParquetFile(path).metadata.num_rows for path in files]
        assert sum(rows) == source.num_rows
        assert max(rows) - min(rows) <= 1
        for path in files:
            metadata = pq.ParquetFile(path).metadata
            assert metadata.num_row_groups > 1
            sizes = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
            assert all(0 < size <= source.rows_per_row_group for size in sizes)


def test_doc_id_is_global_row_index_in_sorted_file_order(
    written: dict[str, pathlib.Path],
) -> None:
    for source in SMALL_SOURCES:
        start = 0
        for path in _files(written[source.name]):
            doc_id = pq.read_table(path, columns=["doc_id"])["doc_id"].to_numpy()
            np.testing.assert_array_equal(doc_id, np.arange(start, start + len(doc_id)))
            start += len(doc_id)
        assert start == source.num_rows


def test_tokens_in_vocab_and_lengths_in_range(written: dict[str, pathlib.Path]) -> None:
    for source in SMALL_SOURCES:
        table = _read_source(written[source.name])
        values = table["input_ids"].combine_chunks().values.to_numpy()
        assert values.min() >= 0
        assert values.max() < VOCAB
        # Many distinct ids are used, not a handful.
        assert len(np.unique(values)) > VOCAB // 2
        lengths = _lengths(table)
        assert lengths.min() >= max(2, source.min_length)
        assert lengths.max() <= source.max_length


def test_default_sources_layout() -> None:
    names = [source.name for source in DEMO_SOURCES]
    assert {"captions", "docs", "code", "chat"} <= set(names)
    assert len(set(names)) == len(names)
    assert 20_000 <= sum(source.num_rows for source in DEMO_SOURCES) <= 30_000
    for source in DEMO_SOURCES:
        assert source.description and "\n" not in source.description
        assert 2 <= source.files <= 3
        smallest_file = source.num_rows // source.files
        assert smallest_file > source.rows_per_row_group  # several row groups per file


def test_default_length_distributions() -> None:
    n = 100_000
    # The text sources; the image-text source's lengths are tested in test_demo_images.py.
    by_name = {source.name: source for source in DEMO_SOURCES if isinstance(source, DemoSource)}
    lengths = {name: sample_lengths(source, n, np.random.default_rng(7)) for name, source in by_name.items()}
    for name, sample in lengths.items():
        assert sample.dtype == np.int64
        assert sample.shape == (n,)
        assert sample.min() >= 2
        assert sample.min() >= by_name[name].min_length
        assert sample.max() <= by_name[name].max_length

    captions = lengths["captions"]
    assert np.mean(captions < 64) >= 0.95
    assert captions.max() > 256
    top = np.sort(captions)[::-1][: n // 50]
    assert top.sum() / captions.sum() > 0.10  # the long tail holds a noticeable share

    docs = lengths["docs"]
    assert 600 <= np.median(docs) <= 900
    assert docs.min() >= 64 and docs.max() <= 2048

    code = lengths["code"]
    assert code.max() <= 2048
    assert np.percentile(code, 10) >= 90  # Pareto from ~100
    assert np.percentile(code, 99) > 5 * np.median(code)  # heavy tail

    chat = lengths["chat"]
    assert 0.3 <= np.mean(chat < 64) <= 0.8  # short turns
    assert np.mean(chat > 256) >= 0.2  # medium conversations
    assert np.mean((chat >= 100) & (chat < 150)) < 0.1  # a trough between the modes

    medians = [float(np.median(sample)) for sample in lengths.values()]
    assert len(set(medians)) == len(medians)
    assert np.median(captions) < np.median(chat) < np.median(code) < np.median(docs)


def test_sample_lengths_is_reproducible() -> None:
    source = DEMO_SOURCES[0]
    a = sample_lengths(source, 1000, np.random.default_rng(3))
    b = sample_lengths(source, 1000, np.random.default_rng(3))
    np.testing.assert_array_equal(a, b)
    assert sample_lengths(source, 0, np.random.default_rng(3)).shape == (0,)


def test_deterministic_bytes(tmp_path: pathlib.Path) -> None:
    sources = tuple(dataclasses.replace(s, num_rows=120, rows_per_row_group=25) for s in SMALL_SOURCES)
    first = write_demo_dataset(tmp_path / "a", sources=sources, vocab_size=VOCAB, seed=5)
    again = write_demo_dataset(tmp_path / "b", sources=sources, vocab_size=VOCAB, seed=5)
    other = write_demo_dataset(tmp_path / "c", sources=sources, vocab_size=VOCAB, seed=6)
    for source in sources:
        a, b, c = (_files(dirs[source.name]) for dirs in (first, again, other))
        assert [p.name for p in a] == [p.name for p in b] == [p.name for p in c]
        for pa_, pb, pc_ in zip(a, b, c):
            assert pa_.read_bytes() == pb.read_bytes()
            assert pa_.read_bytes() != pc_.read_bytes()
    # Overwriting in place gives the same bytes too.
    before = {p: p.read_bytes() for d in first.values() for p in _files(d)}
    write_demo_dataset(tmp_path / "a", sources=sources, vocab_size=VOCAB, seed=5)
    assert {p: p.read_bytes() for d in first.values() for p in _files(d)} == before


def test_progress_reports_rows(tmp_path: pathlib.Path) -> None:
    sources = tuple(dataclasses.replace(s, num_rows=100, rows_per_row_group=20) for s in SMALL_SOURCES)
    calls: list[tuple[str, int, int]] = []
    write_demo_dataset(tmp_path, sources=sources, vocab_size=VOCAB, progress=lambda *call: calls.append(call))
    for source in sources:
        mine = [(written, total) for name, written, total in calls if name == source.name]
        assert len(mine) >= source.files
        assert all(total == source.num_rows for _, total in mine)
        done = [written for written, _ in mine]
        assert done == sorted(done) and len(set(done)) == len(done)
        assert done[-1] == source.num_rows


def _heldout_bigram_nats(rows: list[np.ndarray], vocab: int, alpha: float = 0.1) -> float:
    """Cross-entropy (nats/token) of an add-alpha bigram model fit on even rows, on odd rows."""

    def pairs(selected: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        prev = np.concatenate([r[:-1] for r in selected]).astype(np.int64)
        nxt = np.concatenate([r[1:] for r in selected]).astype(np.int64)
        return prev, nxt

    prev, nxt = pairs(rows[0::2])
    counts = np.zeros((vocab, vocab), dtype=np.float64)
    np.add.at(counts, (prev, nxt), 1.0)
    probs = (counts + alpha) / (counts.sum(axis=1, keepdims=True) + alpha * vocab)
    prev, nxt = pairs(rows[1::2])
    return float(-np.log(probs[prev, nxt]).mean())


def test_tokens_have_learnable_structure(written: dict[str, pathlib.Path]) -> None:
    uniform = math.log(VOCAB)
    for source in SMALL_SOURCES:
        rows = _rows(_read_source(written[source.name]))
        assert sum(len(r) for r in rows) > 10_000
        nats = _heldout_bigram_nats(rows, VOCAB)
        # A previous-token model does far better than guessing uniformly.
        assert nats < 0.5 * uniform, (source.name, nats, uniform)


def test_shuffled_tokens_are_not_learnable(written: dict[str, pathlib.Path]) -> None:
    """Control for the test above: the held-out measure does not flatter unstructured data."""
    rows = _rows(_read_source(written["docs"]))
    rng = np.random.default_rng(0)
    shuffled = [rng.integers(0, VOCAB, size=len(r)) for r in rows]
    assert _heldout_bigram_nats(shuffled, VOCAB) > 0.9 * math.log(VOCAB)


def test_sources_use_different_chains(written: dict[str, pathlib.Path]) -> None:
    # The most frequent successor of token 0 differs between sources.
    successors = {}
    for name, directory in written.items():
        rows = _rows(_read_source(directory))
        prev = np.concatenate([r[:-1] for r in rows])
        nxt = np.concatenate([r[1:] for r in rows])
        successors[name] = int(np.argmax(np.bincount(nxt[prev == 0], minlength=VOCAB)))
    assert len(set(successors.values())) > 1, successors


def test_rejects_bad_arguments(tmp_path: pathlib.Path) -> None:
    twice = (SMALL_SOURCES[0], SMALL_SOURCES[0])
    with pytest.raises(ValueError, match="unique"):
        write_demo_dataset(tmp_path, sources=twice)
    with pytest.raises(ValueError, match="vocab_size"):
        write_demo_dataset(tmp_path, sources=SMALL_SOURCES[:1], vocab_size=1)
    with pytest.raises(ValueError, match="files"):
        dataclasses.replace(SMALL_SOURCES[0], files=0)
    with pytest.raises(ValueError, match="min_length"):
        dataclasses.replace(SMALL_SOURCES[0], min_length=1)
    with pytest.raises(ValueError, match="sigma"):
        LogNormal(median=10, sigma=-1)
