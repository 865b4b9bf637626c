"""FLOPs-based per-sample cost models of transformers: what a sample of a given length costs
to train on a given model, so the planner can balance training work rather than tokens.

`TransformerSpec` describes a decoder or encoder stack (dense or mixture-of-experts, MHA or
GQA, gated or plain MLP, causal or bidirectional attention) and computes forward and training
FLOPs per sequence length in float64. `MODELS` holds the shapes of the models MegaScale-Data
evaluates (its Table 1); `encoder_cost` turns a spec into a cost function of a per-sample
feature, e.g. the image tokens an image encoder sees. Pure numpy: no I/O, no grpc, no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

#: Training FLOPs per forward FLOP: the forward pass plus a backward pass of twice its cost.
TRAINING_MULTIPLIER = 3.0


@dataclasses.dataclass(frozen=True)
class TransformerSpec:
    """The shape of a transformer, for FLOPs counting. Embeddings, norms and the output head
    are left out: they are linear in length and small next to the layers.

    Args:
        name: A label, e.g. "llama-12b".
        layers: Number of transformer layers.
        heads: Number of attention (query) heads.
        hidden: Model width h.
        ffn_hidden: Inner width of one (expert) MLP.
        kv_heads: Number of key/value heads; None means `heads` (MHA), fewer means GQA. Must
            divide `heads`.
        gated_mlp: True for a gated MLP (SwiGLU: 3 weight matrices), False for a plain one (2).
        experts: MLP experts per layer; 1 is a dense model.
        top_k: Experts each token goes through, <= `experts`.
        causal: Causal attention masking, which halves the attention score FLOPs.
    Raises:
        ValueError: naming the field, for a count that is not a positive integer, a flag that
            is not a bool, `top_k` > `experts`, `heads` not divisible by `kv_heads`, or
            `hidden` not divisible by `heads`.
    """

    name: str
    layers: int
    heads: int
    hidden: int
    ffn_hidden: int
    kv_heads: int | None = None
    gated_mlp: bool = True
    experts: int = 1
    top_k: int = 1
    causal: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TransformerSpec.name: must be a non-empty string, got {self.name!r}")
        for field in ("layers", "heads", "hidden", "ffn_hidden", "experts", "top_k"):
            _check_positive(field, getattr(self, field))
        if self.kv_heads is not None:
            _check_positive("kv_heads", self.kv_heads)
            if self.heads % self.kv_heads:
                raise ValueError(f"TransformerSpec.kv_heads: must divide heads ({self.heads}), got {self.kv_heads!r}")
        if self.hidden % self.heads:
            raise ValueError(f"TransformerSpec.hidden: must be divisible by heads ({self.heads}), got {self.hidden!r}")
        if self.top_k > self.experts:
            raise ValueError(f"TransformerSpec.top_k: must be <= experts ({self.experts}), got {self.top_k!r}")
        for field in ("gated_mlp", "causal"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"TransformerSpec.{field}: must be a bool, got {getattr(self, field)!r}")

    @property
    def kv_hidden(self) -> float:
        """Width of the key (and of the value) projection: hidden * kv_heads / heads."""
        kv_heads = self.heads if self.kv_heads is None else self.kv_heads
        return self.hidden * kv_heads / self.heads

    @property
    def params(self) -> int:
        """Approximate parameter count: the attention, MLP (all experts) and router weights of
        every layer; no embeddings, norms or biases.

        Returns:
            layers * (h * (2h + 2 h_kv) + experts * m * h * ffn + [h * experts if experts > 1]),
            with m = 3 for a gated MLP, else 2.
        """
        h = self.hidden
        kv_heads = self.heads if self.kv_heads is None else self.kv_heads
        attention = h * (2 * h + 2 * (h // self.heads) * kv_heads)
        mlp = self.experts * self._mlp_matrices * h * self.ffn_hidden
        router = h * self.experts if self.experts > 1 else 0
        return self.layers * (attention + mlp + router)

    def layer_flops(self, lengths: np.ndarray) -> np.ndarray:
        """Forward FLOPs of one layer on one sequence of each length l (a multiply-add is 2):

            QKV projections     2 l h (h + 2 h_kv)      h_kv = h * kv_heads / heads
            output projection   2 l h h
            attention           2 * 2 l^2 h  (scores QK^T and the weighted sum of V), x 0.5 if causal
            MLP                 2 l h ffn m top_k       m = 3 if gated_mlp else 2
            router              2 l h experts           only when experts > 1

        Args:
            lengths: int64 sequence lengths, any shape; computed in float64, so lengths up to
                2**31 do not overflow.
        Returns:
            float64 FLOPs, the shape of `lengths`.
        """
        x = np.asarray(lengths, dtype=np.float64)
        return x * (self._linear_per_token + self._quadratic_per_token * x)

    def flops(self, lengths: np.ndarray) -> np.ndarray:
        """Forward FLOPs of the whole stack: layers * `layer_flops`.

        Args:
            lengths: int64 sequence lengths, any shape.
        Returns:
            float64 FLOPs, the shape of `lengths`.
        """
        return self.layers * self.layer_flops(lengths)

    def cost(self, lengths: np.ndarray, features: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """Training FLOPs (forward + backward = 3 x forward) of one sequence of each length: a
        batchplane cost function.

        Args:
            lengths: int64 sequence lengths, any shape.
            features: Ignored; accepted so this is a cost function.
        Returns:
            float64 FLOPs, the shape of `lengths`.
        """
        return TRAINING_MULTIPLIER * self.flops(lengths)

    @property
    def _mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def _linear_per_token(self) -> float:
        """Per-layer forward FLOPs that grow linearly in l, per token."""
        h = float(self.hidden)
        projections = 2.0 * h * (h + 2.0 * self.kv_hidden) + 2.0 * h * h
        mlp = 2.0 * h * self.ffn_hidden * self._mlp_matrices * self.top_k
        router = 2.0 * h * self.experts if self.experts > 1 else 0.0
        return projections + mlp + router

    @property
    def _quadratic_per_token(self) -> float:
        """Per-layer forward attention FLOPs per (query, key) pair."""
        return 4.0 * self.hidden * (0.5 if self.causal else 1.0)


def _check_positive(field: str, value: object) -> None:
    """Checks that a spec field is a positive int (not a bool).

    Args:
        field: The field's name.
        value: Its value.
    Raises:
        ValueError: naming the field, when it is not.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"TransformerSpec.{field}: must be a positive integer, got {value!r}")


def encoder_cost(spec: TransformerSpec, *, feature: str = "image_tokens") -> Callable[..., np.ndarray]:
    """A cost function charging each sample `spec.cost` of a per-sample feature instead of its
    text length, e.g. the image tokens an image encoder processes. A sample's tokens are
    counted as one sequence (one image, or images packed into one sequence).

    Args:
        spec: The encoder's shape.
        feature: Name of the per-sample feature holding the token count (float64, cast to int64).
    Returns:
        `cost(lengths, features)` -> float64 training FLOPs [n]; 0 for a sample with 0 tokens.
        It raises ValueError when `feature` is missing from `features` (naming it and those
        present), has a shape other than the lengths', or holds a negative or non-finite value.
    """

    def feature_cost(lengths: np.ndarray, features: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """`spec.cost` of `features[feature]`; see `encoder_cost`."""
        available = sorted(features or {})
        if feature not in available:
            raise ValueError(f"cost of {spec.name!r} needs the per-sample feature {feature!r}; features available: {available}")
        tokens = np.asarray(features[feature], dtype=np.float64)  # type: ignore[index]
        shape = np.shape(lengths)
        if tokens.shape != shape:
            raise ValueError(f"feature {feature!r} has shape {tokens.shape}, expected the lengths' shape {shape}")
        bad = ~np.isfinite(tokens) | (tokens < 0)
        if bad.any():
            i = int(np.flatnonzero(bad.ravel())[0])
            raise ValueError(f"feature {feature!r} must be finite and >= 0, got {float(tokens.ravel()[i])!r} at index {i}")
        return spec.cost(tokens.astype(np.int64))

    feature_cost.__qualname__ = feature_cost.__name__ = f"encoder_cost[{spec.name}:{feature}]"
    return feature_cost


# The models MegaScale-Data evaluates (Table 1). The table gives layers, heads and hidden size
# only (and top-k for the MoE models); the other fields are assumptions, stated per model.
# `params` counts layer weights only (no embeddings).

#: ViT-g/14 shape (Zhai et al., 2022): MLP width 6144, plain GELU MLP, bidirectional. ~0.98B.
VIT_1B = TransformerSpec(name="vit-1b", layers=39, heads=16, hidden=1408, ffn_hidden=6144, gated_mlp=False, causal=False)

#: ViT-G/14 shape: MLP width 8192, plain GELU MLP, bidirectional. ~1.84B.
VIT_2B = TransformerSpec(name="vit-2b", layers=48, heads=16, hidden=1664, ffn_hidden=8192, gated_mlp=False, causal=False)

#: Llama-3-style: SwiGLU of width 8/3 h = 12288, MHA (assumed; no GQA), causal. ~11.5B
#: (about 12.6B with a 128k-token vocabulary's embeddings and head).
LLAMA_12B = TransformerSpec(name="llama-12b", layers=45, heads=36, hidden=4608, ffn_hidden=12288)

#: tMoE is a production model: 64 SwiGLU experts of width 1408 (DeepSeekMoE's expert shape),
#: top-2, MHA, causal, chosen so the total is about 25B. ~24.0B.
TMOE_25B = TransformerSpec(name="tmoe-25b", layers=42, heads=16, hidden=2048, ffn_hidden=1408, experts=64, top_k=2)

#: Mixtral 8x7B's published shape: GQA with 8 KV heads, SwiGLU width 14336, 8 experts, top-2.
#: ~46.4B (46.7B with embeddings and head).
MIXTRAL_8X7B = TransformerSpec(name="mixtral-8x7b", layers=32, heads=32, kv_heads=8, hidden=4096, ffn_hidden=14336, experts=8, top_k=2)

#: The built-in models by lowercase name.
MODELS: dict[str, TransformerSpec] = {m.name: m for m in (VIT_1B, VIT_2B, LLAMA_12B, TMOE_25B, MIXTRAL_8X7B)}
