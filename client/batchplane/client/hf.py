"""Hugging Face adapter of the client: batchplane microbatches as the keyword arguments of a
Hugging Face causal LM (`transformers`, optional: imported only where a function needs it, never
at import time).

Two label conventions meet here. batchplane's `labels` are PRE-SHIFTED, as the loss code of
Megatron-LM and torchtitan expects them: labels[r, t] is the target of position t, i.e.
input_ids[r, t + 1] when t and t + 1 lie in the same sequence, else `ignore_id` (also on
padding). A Hugging Face causal LM shifts `labels` itself: it compares logits[:, :-1] with
labels[:, 1:], so passing batchplane's labels would train position t on token t + 2. Hugging
Face labels are UNSHIFTED: hf_labels[r, t + 1] = labels[r, t] (ignore_id replaced by -100) and
hf_labels[r, 0] = -100, so that after the model's own shift position t targets exactly what
labels[r, t] named:

    input_ids   a  b  c | d  e  <pad>          (two sequences packed in one row)
    labels      b  c  ·   e  ·  ·              (batchplane, pre-shifted; · = ignore_id)
    hf_labels   ·  b  c   ·  e  ·              (Hugging Face, unshifted; · = -100)

Usage, with any Hugging Face causal LM (`model`) in one process (fillers under DDP/FSDP: see
`causal_lm_inputs`):

    for batch in client:
        for mb in (mb for mb in batch["microbatches"] if not mb["filler"]):
            model(**causal_lm_inputs(mb, dtype=model.dtype)).loss.backward()

Packed rows need more than labels: their 2-D attention_mask is True on every real token, so a
Hugging Face model's default causal attention would let a document attend to the documents
before it in its row. `causal_lm_inputs` keeps them apart in one of three ways (see
PACKED_ATTENTION). A "sequence" is a run of positions starting at 0 (one segment of a packed
row, one padded row); a sample that the constructor split into chunks is several sequences.

Only tensor arithmetic on the microbatch; no I/O, no model. Context-parallel slices are not
supported (a Hugging Face model has no ring attention; their labels may point past the slice).

The Hugging Face Trainer. `batchplane.client.hf.Trainer` is a `transformers.Trainer` that trains
on a batchplane job with this conversion: each rank reads its own batches from its client (one
item = one step's batch dict), the step's microbatches are its gradient accumulation (under DDP's
no_sync but the last), every microbatch's loss is weighted by the step's exact token counts
(`global_loss_tokens`), `max_steps` defaults to the job's steps, and every checkpoint holds the
client's state (`batchplane_data.json`), which `train(resume_from_checkpoint=...)` restores:

    from batchplane.client.hf import Trainer
    trainer = Trainer(model=model, args=TrainingArguments(output_dir="out", save_steps=500))
    trainer.train(resume_from_checkpoint=True)       # under torchrun, one process per rank

It lives in `batchplane.client.hf_trainer` (it subclasses transformers.Trainer, so that module
imports transformers) and is re-exported here on first access (module `__getattr__`), so importing
this module still imports no transformers.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["PACKED_ATTENTION", "Trainer", "causal_lm_inputs", "hf_labels", "packed_mask_4d"]  # noqa: F822 - Trainer comes from __getattr__

#: The label Hugging Face's loss ignores.
HF_IGNORE_INDEX = -100
#: batchplane's label of positions without a target when a microbatch does not say.
DEFAULT_IGNORE_ID = -100

#: How `causal_lm_inputs` keeps the sequences of a packed row apart, by `packed_attention`:
#: "mask_4d": an additive 4-D attention mask [R, 1, W, W] (eager and sdpa attention; any
#: transformers that accepts custom 4-D masks); "varlen": the real tokens flattened to one row
#: with flash-attention's cu_seq_lens_q/k and max_length_q/k; "position_ids": rows as they are,
#: no attention_mask, position ids restarting at 0 per sequence.
PACKED_ATTENTION = ("mask_4d", "varlen", "position_ids")

# What every conversion needs, and what each layout needs besides.
_COMMON = ("input_ids", "labels", "position_ids")
_PADDED = ("attention_mask",)
_PACKED = ("segment_ids",)
# transformers' flash-attention varlen keywords (FlashAttentionKwargs), checked on first use.
_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


# ---- microbatch -> model inputs ----------------------------------------------------------


def causal_lm_inputs(
    microbatch: Mapping[str, Any],
    *,
    packed_attention: str = "mask_4d",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor | int | bool]:
    """The keyword arguments of a Hugging Face causal LM for one batchplane microbatch:
    `model(**causal_lm_inputs(mb))` computes its forward pass and Hugging Face's mean loss.

    Returns `input_ids`, `position_ids` and `labels` (int64; labels in Hugging Face's unshifted
    convention, see the module docstring), `use_cache=False`, and what keeps sequences apart:
    - a padded microbatch (no `segment_ids`): its 2-D `attention_mask` as int64 (1 on real
      tokens), which every Hugging Face model accepts (some compute `1 - mask`, which a bool
      tensor does not allow); in a row without real tokens (a filler) the first padding token
      is marked 1 so that it has itself to attend to;
    - a packed microbatch (with `segment_ids`), by `packed_attention`:
      "mask_4d": `attention_mask`, an additive float mask [R, 1, W, W] in `dtype`: 0 where
      query t may attend key u (same sequence, u <= t), torch.finfo(dtype).min elsewhere; a
      padding query attends only to itself, so no row of the softmax is empty (no NaN).
      Memory: R * W * W elements of `dtype`, plus as many bools while it is built (2 + 1 GiB
      for R = 16 rows of W = 8192 tokens in bfloat16), and eager attention adds it to scores
      of the same size per layer; for long rows prefer "varlen" with flash-attention. Works
      with eager and sdpa attention (not flash-attention, which takes no 4-D mask).
      "varlen": the microbatch's real tokens flattened to one row (input_ids, position_ids,
      labels of shape [1, T]) plus `cu_seq_lens_q` = `cu_seq_lens_k` (int32 [n + 1], the
      sequences' offsets into the T tokens) and `max_length_q` = `max_length_k` (int, the
      longest sequence); no attention_mask. flash_attention_2/3 use the cu_seq_lens directly;
      sdpa, eager and flex ignore them and separate the sequences from the restarting position
      ids (transformers' packed-sequence detection, below).
      "position_ids": the rows as they are, no attention_mask, position ids restarting at 0 for
      every sequence. Relies on transformers' packed-sequence detection (below) for sdpa,
      eager and flex attention. flash-attention detects packing from position ids only in a
      batch of one row, so it would mix the sequences of R > 1 rows: use "varlen" there.
    Packed-sequence detection: with attention_mask None and no cache, transformers'
    masking_utils.find_packed_sequence_indices starts a new sequence wherever a position id is
    not the previous one + 1, and create_causal_mask masks across them (per row, any batch
    size). It arrived with transformers 4.54 (huggingface/transformers#39194, July 2025; 4.53
    had masking_utils without it) and is what transformers 5.24 does; older versions ignore
    position ids for masking under sdpa/eager. A cache turns it off: Llama-style models create
    one whenever use_cache is true, which is the default of their configs, so the returned
    `use_cache=False` matters (training needs no cache anyway).

    Labels: every target of batchplane's labels is kept at the same position after the model's
    shift, so the loss is exactly that of the pre-shifted labels; each sequence's first token
    and padding get -100, and a custom mask a hook wrote into `labels` (ignore_id where nothing
    is learned) is honoured. A `loss_mask` tensor, when present, masks labels further.

    Filler microbatches (`filler` True: one padding row, no labels) convert like any other and
    run; every label is -100, so they add nothing to a loss. Hugging Face's default MEAN loss of
    a microbatch without labels is NaN (0 / 0), and a NaN backward poisons the gradients of
    every rank. Fillers exist so that every data-parallel rank runs the same number of
    microbatches (a finite job's last step): under DDP/FSDP still run their forward and
    backward (their collectives must happen on every rank) with a summed loss: pass
    `num_items_in_batch` (the count the step's loss is normalized by, e.g. the batch's
    "global_loss_tokens") and Hugging Face sums, which gives exactly 0 and zero gradients for a
    filler. A single process may skip them.

    Non-tensor metadata ("num_tokens", "loss_tokens", "filler", "loss_weight", "ignore_id") and
    the other tensors (sample_*, cu_seqlens, max_seqlen, a hook's extra tensors) are not passed.
    The inputs stay on the microbatch's device.

    Args:
        microbatch: One microbatch of a batch's "microbatches" as the client yields it.
        packed_attention: One of PACKED_ATTENTION; only used for packed microbatches.
        dtype: The dtype of the "mask_4d" mask: the model's (e.g. torch.bfloat16, as sdpa
            wants the mask in the query's dtype). Default torch.float32. Unused otherwise.
    Returns:
        The keyword arguments, a new dict; the microbatch is not changed (input_ids and
        position_ids are its own tensors when they already are int64).
    Raises:
        ValueError: a required tensor is missing (input_ids, labels, position_ids, and
            attention_mask for a padded or segment_ids for a packed microbatch; e.g. the
            microbatch of a later pipeline stage), an unknown `packed_attention`, a non-float
            `dtype`, or a label on the last column, which Hugging Face's shift cannot
            express (a context-parallel slice).
        RuntimeError: the installed transformers lacks what `packed_attention` relies on
            ("varlen": the flash-attention varlen keywords; "position_ids": packed-sequence
            detection), or transformers is not installed.
    """
    if packed_attention not in PACKED_ATTENTION:
        raise ValueError(f"packed_attention must be one of {', '.join(PACKED_ATTENTION)}, got {packed_attention!r}")
    packed = "segment_ids" in microbatch
    _require(microbatch, _COMMON + (_PACKED if packed else _PADDED))
    ignore_id = microbatch.get("ignore_id")
    ignore_id = DEFAULT_IGNORE_ID if ignore_id is None else int(ignore_id)
    labels = microbatch["labels"]
    if "loss_mask" in microbatch:
        labels = torch.where(microbatch["loss_mask"].bool(), labels, ignore_id)
    input_ids = microbatch["input_ids"].long()
    position_ids = microbatch["position_ids"].long()

    if not packed:
        mask = microbatch["attention_mask"].to(torch.int64, copy=True)
        # A row without real tokens (a filler) lets its first token attend to itself: a query
        # with no key to attend to gives NaN in some attention paths (eager in float64).
        mask[:, 0] |= mask.sum(dim=1) == 0
        return {
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": position_ids,
            "labels": hf_labels(labels, ignore_id=ignore_id),
            "use_cache": False,
        }
    segments = microbatch["segment_ids"]
    if packed_attention == "varlen":
        _check_transformers("varlen")
        return _varlen(input_ids, position_ids, labels, segments, ignore_id=ignore_id)
    out: dict[str, torch.Tensor | int | bool] = {"input_ids": input_ids}
    if packed_attention == "mask_4d":
        out["attention_mask"] = packed_mask_4d(segments, dtype=torch.float32 if dtype is None else dtype)
    else:
        _check_transformers("position_ids")
    out["position_ids"] = position_ids
    out["labels"] = hf_labels(labels, ignore_id=ignore_id)
    out["use_cache"] = False
    return out


def hf_labels(labels: torch.Tensor, *, ignore_id: int = DEFAULT_IGNORE_ID) -> torch.Tensor:
    """Pre-shifted labels (target of position t at t) in Hugging Face's unshifted convention
    (target of position t at t + 1), along the last dimension.

    Args:
        labels: batchplane's labels, [..., W].
        ignore_id: Their label of positions without a target.
    Returns:
        int64 [..., W]: out[..., t + 1] = labels[..., t], ignore_id replaced by -100, and
        out[..., 0] = -100.
    Raises:
        ValueError: labels[..., -1] has a target (the shift would drop it; batchplane puts
            ignore_id there unless the microbatch is a context-parallel slice).
    """
    last = labels[..., -1:]
    if bool((last != ignore_id).any()):
        raise ValueError(
            "labels: the last column has targets, which Hugging Face's label shift cannot express "
            "(a context-parallel slice? Hugging Face models do not support them)"
        )
    out = torch.full(labels.shape, HF_IGNORE_INDEX, dtype=torch.int64, device=labels.device)
    shifted = labels[..., :-1].long()
    if ignore_id != HF_IGNORE_INDEX:
        shifted = shifted.masked_fill(shifted == ignore_id, HF_IGNORE_INDEX)
    out[..., 1:] = shifted
    return out


def packed_mask_4d(segment_ids: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The additive attention mask of packed rows: [R, 1, W, W] of `dtype`, 0 where query t may
    attend key u (the same segment, u <= t; a padding query only itself) and
    torch.finfo(dtype).min elsewhere. R * W * W elements of `dtype`, plus as many bools while
    it is built.

    Args:
        segment_ids: [R, W], 1, 2, ... per sequence within a row, 0 on padding.
        dtype: A floating dtype.
    Raises:
        ValueError: `dtype` is not a floating dtype.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype for an additive mask, got {dtype}")
    width = segment_ids.shape[-1]
    arange = torch.arange(width, device=segment_ids.device)
    causal = arange[None, :] <= arange[:, None]  # [query, key]
    allowed = segment_ids[:, :, None] == segment_ids[:, None, :]  # the one [R, W, W] of bools
    allowed &= causal
    allowed &= (segment_ids != 0)[:, :, None]  # a real query ...
    allowed |= torch.eye(width, dtype=torch.bool, device=segment_ids.device)  # ... or itself
    mask = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=segment_ids.device)
    mask.masked_fill_(allowed, 0)
    return mask[:, None]


def _varlen(
    input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor, segments: torch.Tensor, *, ignore_id: int
) -> dict[str, torch.Tensor | int | bool]:
    real = segments != 0
    if not bool(real.any()):  # a filler: its one padding token becomes a sequence of its own
        real = torch.zeros_like(real)
        real.view(-1)[0] = True
    rows = torch.arange(segments.shape[0], device=segments.device)[:, None].expand_as(segments)[real]
    seg = segments[real]
    # A sequence starts at a row's first token and wherever the segment changes.
    starts = torch.ones(seg.shape, dtype=torch.bool, device=seg.device)
    starts[1:] = (seg[1:] != seg[:-1]) | (rows[1:] != rows[:-1])
    ends = torch.tensor([seg.numel()], device=seg.device)
    cu = torch.cat([starts.nonzero().view(-1), ends]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    flat_labels = labels[real]
    return {
        "input_ids": input_ids[real][None],
        "position_ids": position_ids[real][None],
        "labels": hf_labels(flat_labels, ignore_id=ignore_id)[None],
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
        "use_cache": False,
    }


def _require(microbatch: Mapping[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        value = microbatch.get(name)
        if not isinstance(value, torch.Tensor):
            kind = "packed" if "segment_ids" in microbatch else "padded"
            raise ValueError(
                f"microbatch has no tensor {name!r}, which a {kind} microbatch needs for a Hugging Face causal LM "
                f"(it has {sorted(k for k, v in microbatch.items() if isinstance(v, torch.Tensor))}; "
                "a later pipeline stage's microbatch lacks the inputs)"
            )


@functools.cache
def _check_transformers(packed_attention: str) -> None:
    """Raises RuntimeError when the installed transformers lacks what `packed_attention` needs."""
    try:
        import transformers
    except ImportError as exc:
        raise RuntimeError(f"packed_attention={packed_attention!r} needs transformers (pip install batchplane[hf])") from exc
    version = getattr(transformers, "__version__", "?")
    if packed_attention == "varlen":
        try:
            from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
        except ImportError:
            known: set[str] = set()
        else:
            known = set(getattr(FlashAttentionKwargs, "__annotations__", {}))
        missing = [k for k in _VARLEN_KEYS if k not in known]
        if missing:
            raise RuntimeError(
                f"transformers {version} does not take the flash-attention keywords {missing}: "
                "use packed_attention='mask_4d', or transformers >= 4.56"
            )
    elif packed_attention == "position_ids":
        try:
            from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(
                f"transformers {version} does not detect packed sequences from position ids "
                "(masking_utils.find_packed_sequence_indices, transformers >= 4.54): "
                "use packed_attention='mask_4d'"
            ) from exc


# ---- the Hugging Face Trainer, imported on first use ---------------------------------------

# Names defined in a submodule that imports transformers, resolved by `__getattr__`.
_LAZY = {"Trainer": "batchplane.client.hf_trainer"}


def __getattr__(name: str) -> Any:
    """`Trainer` (batchplane.client.hf_trainer.Trainer), imported with transformers on first
    access; any other unknown name raises AttributeError."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later accesses skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
