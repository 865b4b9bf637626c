"""The journal of transactional global batches (BatchWeave, issue 18): whole steps as immutable
objects on a `batchplane.core.storage.Storage`, made visible by committing versioned manifests.

Modules:

- `manifest`: the state of one manifest version (committed steps, producers' state, retention
  watermark, live checkpoint marks), its JSON encoding, and the pure rules of a commit
  (`apply`, `rebase`). No I/O.
- `policy`: when a producer attempts a commit: Naive, FIXED10/FIXED100, INCR, AIMD and
  Decentralized Adaptive Commit (DAC). No I/O, no clocks (times are inputs).
- `commit`: the I/O driver: `ManifestStore` (finds, reads and puts manifest versions) and
  `Producer` (registers a fenced producer id, commits built steps exactly once, rebases on
  conflict).
- `tgb`: the byte layout of one step's TGB (every DP x CP slice, a footer index, a trailer) and
  its hostile-input decoding, whole or one slice by range reads. No I/O.
- `slices`: which written slices a rank reads at a logical step when DP or CP changed at resume
  (the paper's remapping), and the cursor arithmetic. No I/O.
- `retention`: what may be reclaimed below the live checkpoints' watermarks, and when producers
  must pause (`max_lag`). No I/O.
- `writer`: the producer's driver: `JournalWriter` (the journal's header, one TGB object per
  step, commits through `commit.Producer`, orphans deleted, `max_lag` backpressure).
- `reader`: the consumer's driver: `JournalReader` (follows the manifest, range-reads only the
  needed slices, remaps DP/CP, prefetches) and `Watermarks` (live checkpoint marks).
- `reclaim`: the reclaimer's driver: `Reclaimer` deletes what no live mark needs.
- `location`: where a job's journal lies (`journal.location`, else `<run_dir>/journal`) and
  opening it.

The package re-exports nothing: importing it must not pull in the object-store client that
`commit` needs.
"""
