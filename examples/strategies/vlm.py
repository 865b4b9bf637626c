"""Vision-language balancing (MegaScale-Data, Algorithm 2): the LLM backbone and the vision
encoder are balanced separately.

The backbone graph ("text") is the long/short strategy of llm_long_short.py: samples mixed by
the job's weights, distributed over the data-parallel replicas, costed by a 12B Llama-style
model's training FLOPs and balanced with Karmarkar-Karp over replicas and microbatches. The
encoder graph ("images") holds the samples with images (a positive "image_tokens" feature
reported by the loaders), spreads them over every rank of the world (the encoder runs data
parallel on all GPUs and sends embeddings back all-to-all), costs them by a 2B ViT's FLOPs of
their image tokens and balances them greedily (longest processing time first). The encoder
graph delivers the images' pixels: each rank receives, in `batch["subbatches"]["images"]`,
`pixel_values` and `image_grid_thw` of exactly the images it encodes, whichever replica trains
their samples (its constructor fetches them), and the microbatches carry no pixels
(`batchplane.client.vision.vision_inputs` turns them into a Qwen2-VL encoder's inputs).

Use it by naming the file in the job configuration (relative to the configuration file); the
job must declare the delivered columns in `batch.payload` (as `batchplane.demo.images.PAYLOAD`
does) and its image source must ship them (the demo's `image_text` transform with `pixels: true`):

    strategy: examples/strategies/vlm.py
    batch:
      payload:
        - {name: pixel_values, kind: blob, dtype: uint8, shape: [588]}
        - {name: image_grid_thw, kind: blob, dtype: int64, shape: [3]}
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
    images = DGraph("images", metadata="image_tokens")
    images.distribute(axis="WORLD")
    images.cost(models.VIT_2B.cost)
    images.balance("greedy")
    images.deliver("pixel_values", "image_grid_thw")
    return text.plan(images)
