"""The constructor: a sidecar next to the trainers of one pod. Fetches the planned samples of
its ranks, builds their microbatches ahead of time and serves them; never reorders or drops
planned samples."""
