"""The source loader: owns each source's file state once, reads it ahead in the job's order,
transforms samples, summarizes its buffer for the planner and sends planned samples to
constructors. It never decides which rank gets a sample."""

from batchplane.loader.transforms import per_sample, token_ids

__all__ = ["per_sample", "token_ids"]
