"""Long/short sequence balancing for a text-only LLM (MegaScale-Data, Algorithm 1).

Every step's samples are mixed by the job's `mixture.weights`, distributed over the
data-parallel replicas (CP peers get slices of the same sequences, TP peers identical tensors),
costed by the training FLOPs of a 12B Llama-style model (attention makes a long sequence cost
far more than its tokens) and balanced with Karmarkar-Karp, first over the replicas, then over
each replica's microbatches, so no rank waits for one that drew the long sequences.

Use it by naming the file in the job configuration (relative to the configuration file):

    strategy: examples/strategies/llm_long_short.py
"""

from batchplane.planner import DGraph, models


def strategy(mesh):
    text = DGraph("text", metadata="length")
    text.mix()  # the job's mixture.weights
    text.distribute(axis="DP")
    text.cost(models.LLAMA_12B.cost)
    # 2 microbatches per replica keep demo-sized jobs full (global_batch_size >= 2 * dp);
    # real jobs use their gradient-accumulation steps here (e.g. 8 or 16).
    text.balance("karmarkar_karp", microbatches=2)
    return text.plan()
