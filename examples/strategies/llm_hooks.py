"""Long/short balancing (as llm_long_short.py) plus the two low-level hooks that run outside
the planner: one in the loaders, one in the constructors.

- `clip_vocabulary` (loader_do_plan) maps token ids the model's vocabulary does not hold
  (>= VOCAB_SIZE, e.g. after shrinking a tokenizer) to UNK_ID in the loaders, before anything
  is sent. It keeps every sample's length: the plan counted its tokens.
- `sample_loss_weights` (constructor_do_plan) adds `loss_weights`, a per-token float32 tensor
  that gives every sample of a microbatch the same total weight (a per-sample mean loss
  instead of a per-token one): 1 / (the sample's label tokens) on each label token. It is
  per-token (shaped like input_ids), so CP ranks get their slice of it.

Both are plain functions at the top level of this file: loaders and constructors import the
file and look them up by name. For padded batches (`batch.packing` off) and ignore_id -100.

    strategy: examples/strategies/llm_hooks.py
"""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchplane.planner import DGraph, models

VOCAB_SIZE = 32_000
UNK_ID = 1
IGNORE_ID = -100


def clip_vocabulary(samples, plan):
    ids = samples.column("input_ids").combine_chunks()
    tokens = ids.values
    clipped = pa.ListArray.from_arrays(ids.offsets, pc.if_else(pc.less(tokens, VOCAB_SIZE), tokens, pa.scalar(UNK_ID, tokens.type)))
    return samples.set_column(samples.schema.get_field_index("input_ids"), "input_ids", clipped)


def sample_loss_weights(tensors, context):
    has_label = tensors["labels"] != IGNORE_ID
    per_sample = np.maximum(has_label.sum(axis=1, keepdims=True), 1)
    tensors["loss_weights"] = (has_label / per_sample).astype(np.float32)
    return tensors


def strategy(mesh):
    text = DGraph("text", metadata="length")
    text.mix()
    text.distribute(axis="DP")
    text.cost(models.LLAMA_12B.cost)
    text.balance("karmarkar_karp", microbatches=2)
    text.loader_do_plan(clip_vocabulary)
    text.constructor_do_plan(sample_loss_weights)
    return text.plan()
