"""batchplane.client.hf.causal_lm_inputs against a tiny random Hugging Face Llama: microbatches
built by the constructor's own code (assemble, pack) and unpacked as the client does, checked
document by document against each document run alone, and the Hugging Face loss against the
cross-entropy of batchplane's pre-shifted labels."""

from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from batchplane.client.hf import PACKED_ATTENTION, causal_lm_inputs, hf_labels, packed_mask_4d
from batchplane.client.tensors import unpack
from batchplane.constructor.assemble import RankSamples, assemble
from batchplane.constructor.parallel import cp_slice, pack, stage_filter

VOCAB = 101
PAD = 0
DTYPE = torch.float64  # exact enough to compare logits tightly
# How close a document's logits are to those of the document alone. sdpa runs in float64; eager
# takes its softmax in float32, whose sums round differently over rows of other lengths.
TOLERANCE = {"sdpa": {"rtol": 1e-9, "atol": 1e-9}, "eager": {"rtol": 1e-5, "atol": 1e-7}}


# ---- building microbatches as the constructor and the client do ---------------------------


def _tokens(rng: np.random.Generator, lengths: list[int]) -> list[np.ndarray]:
    return [rng.integers(1, VOCAB, size=n).astype(np.int64) for n in lengths]


def _microbatches(
    tokens: list[np.ndarray],
    offsets: list[int],
    *,
    pack_length: int | None = None,
    ignore_id: int = -100,
    token_dtype: str = "int64",
) -> list[dict]:
    """The client's view of one rank's step: tensors unpacked from the built payload, plus the
    microbatch metadata (see Client._fetch)."""
    n = len(tokens)
    samples = RankSamples(
        tokens=tokens,
        source=np.zeros(n, np.int32),
        row=np.arange(n, dtype=np.int64),
        epoch=np.zeros(n, np.int32),
        offsets=np.array(offsets, np.int64),
    )
    built = assemble(
        samples,
        step=0,
        rank=0,
        pad_id=PAD,
        ignore_id=ignore_id,
        token_dtype=token_dtype,
        global_loss_tokens=max(sum(len(t) - 1 for t in tokens), 1),
        pack_length=pack_length,
    )
    storage = torch.frombuffer(built.payload, dtype=torch.uint8)
    out = []
    for layout in built.microbatches:
        mb = unpack(storage, layout.tensors)
        mb.update(num_tokens=layout.num_tokens, loss_tokens=layout.loss_tokens, filler=layout.filler, loss_weight=layout.loss_weight)
        if ignore_id != -100:
            mb["ignore_id"] = ignore_id
        out.append(mb)
    return out


def _from_numpy(arrays: dict, **meta) -> dict:
    return {**{k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}, **meta}


@pytest.fixture(scope="module", params=["eager", "sdpa"])
def model(request):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=request.param,
    )
    model = transformers.LlamaForCausalLM(config).to(DTYPE).eval()
    model.tolerance = TOLERANCE[request.param]
    return model


def _alone(model, tokens) -> torch.Tensor:
    """Logits of one document run alone, no padding, no mask."""
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long)[None], use_cache=False).logits[0]


def _run(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _documents(mb: dict) -> list[tuple[int, torch.Tensor]]:
    """(row, columns) of every sequence of a packed microbatch, row-major (segment_ids)."""
    docs = []
    for r, row in enumerate(mb["segment_ids"]):
        for s in range(1, int(row.max()) + 1):
            docs.append((r, (row == s).nonzero().view(-1)))
    return docs


# ---- 1. packed: every document as if alone -------------------------------------------------


@pytest.mark.parametrize("mode", PACKED_ATTENTION)
def test_packed_documents_equal_each_document_alone(model, mode: str) -> None:
    rng = np.random.default_rng(1)
    tokens = _tokens(rng, [5, 3, 7, 1, 4, 6, 2, 9, 3])
    mbs = _microbatches(tokens, [0, 6, 9], pack_length=12, token_dtype="int32")
    at = 0
    for mb in mbs:
        assert mb["segment_ids"].shape[0] > 1 and (mb["segment_ids"] == 0).any()  # several rows, with padding
        logits = _run(model, causal_lm_inputs(mb, packed_attention=mode, dtype=DTYPE))
        docs = _documents(mb)
        assert len(docs) == len(mb["sample_length"])
        cu = mb["cu_seqlens"].long()
        for i, (r, cols) in enumerate(docs):
            doc = tokens[at + i]
            assert mb["input_ids"][r, cols].tolist() == doc.tolist()
            got = logits[0, cu[i] : cu[i + 1]] if mode == "varlen" else logits[r, cols]
            torch.testing.assert_close(got, _alone(model, doc), **model.tolerance)
        at += len(docs)
    assert at == len(tokens)


def test_the_plain_2d_mask_would_mix_the_documents_of_a_row(model) -> None:
    """The check above can fail: with the packed row's own 2-D attention_mask, a document that
    is not first in its row attends to the ones before it."""
    rng = np.random.default_rng(1)
    tokens = _tokens(rng, [5, 3, 7])
    (mb,) = _microbatches(tokens, [0, 3], pack_length=16)
    logits = _run(model, {"input_ids": mb["input_ids"].long(), "attention_mask": mb["attention_mask"].long(), "use_cache": False})
    (_, first), (_, second), _ = _documents(mb)
    torch.testing.assert_close(logits[0, first], _alone(model, tokens[0]), **model.tolerance)
    assert not torch.allclose(logits[0, second], _alone(model, tokens[1]), **model.tolerance)


@pytest.mark.parametrize("mode", PACKED_ATTENTION)
def test_a_split_sample_is_several_sequences(model, mode: str) -> None:
    """One sample cut into chunks (positions restarting at 0, a segment each): every chunk is a
    sequence of its own, and fewer sample_* entries than sequences change nothing."""
    rng = np.random.default_rng(2)
    long, short = _tokens(rng, [11, 3])
    chunks = [long[:6], long[6:], short]
    arrays = pack(chunks, max_length=16, pad_id=PAD, ignore_id=-100, dtype="int64")
    arrays.pop("sample_rows")
    mb = _from_numpy(arrays, sample_length=np.array([11, 3], np.int32), filler=False)
    assert mb["segment_ids"].tolist() == [[1] * 6 + [2] * 5 + [3] * 3]
    logits = _run(model, causal_lm_inputs(mb, packed_attention=mode, dtype=DTYPE))
    for (r, cols), chunk in zip(_documents(mb), chunks, strict=True):
        torch.testing.assert_close(logits[r, cols], _alone(model, chunk), **model.tolerance)


# ---- 2. padded: every row as if alone ------------------------------------------------------


def test_padded_rows_equal_each_row_alone(model) -> None:
    rng = np.random.default_rng(3)
    tokens = _tokens(rng, [5, 9, 1, 4, 7, 2])
    mbs = _microbatches(tokens, [0, 3, 6])
    at = 0
    for mb in mbs:
        inputs = causal_lm_inputs(mb)
        assert inputs["attention_mask"].dtype == torch.int64
        logits = _run(model, inputs)
        for b in range(mb["input_ids"].shape[0]):
            n = int(mb["attention_mask"][b].sum())
            assert n == len(tokens[at + b])
            torch.testing.assert_close(logits[b, :n], _alone(model, tokens[at + b]), **model.tolerance)
        at += mb["input_ids"].shape[0]


# ---- 3. labels: Hugging Face's shift lands exactly on batchplane's targets -----------------


def _our_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_id: int) -> torch.Tensor:
    """The loss of pre-shifted labels, as Megatron/torchtitan take it (in float32, as
    Hugging Face's loss upcasts the logits to)."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.long().flatten(), ignore_index=ignore_id)


@pytest.mark.parametrize("ignore_id", [-100, -1])
@pytest.mark.parametrize("mode", [None, *PACKED_ATTENTION])
def test_hf_loss_equals_the_loss_of_the_pre_shifted_labels(model, mode: str | None, ignore_id: int) -> None:
    rng = np.random.default_rng(4)
    for _ in range(3):
        lengths = rng.integers(1, 12, size=6).tolist()
        mbs = _microbatches(_tokens(rng, lengths), [0, 2, 6], pack_length=None if mode is None else 14, ignore_id=ignore_id)
        for mb in mbs:
            # A hook's custom mask: some targets not learned.
            mb["labels"].masked_fill_(torch.from_numpy(rng.random(mb["labels"].shape) < 0.3), ignore_id)
            inputs = causal_lm_inputs(mb, packed_attention=mode or "mask_4d", dtype=DTYPE)
            with torch.no_grad():
                out = model(**inputs)
            labels = mb["labels"][mb["attention_mask"]] if mode == "varlen" else mb["labels"]
            if not (labels != ignore_id).any():
                continue
            torch.testing.assert_close(out.loss, _our_loss(out.logits, labels, ignore_id), rtol=1e-6, atol=1e-6)


def test_hf_labels_by_hand() -> None:
    a, b, c, d, e, pad = 11, 12, 13, 14, 15, 0
    # Packed: two sequences and padding in one row, ignore_id -1.
    mb = {
        "input_ids": torch.tensor([[a, b, c, d, e, pad]], dtype=torch.int32),
        "labels": torch.tensor([[b, c, -1, e, -1, -1]], dtype=torch.int32),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]], dtype=torch.int32),
        "segment_ids": torch.tensor([[1, 1, 1, 2, 2, 0]], dtype=torch.int32),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool),
        "ignore_id": -1,
        "filler": False,
    }
    want = [[-100, b, c, -100, e, -100]]
    assert causal_lm_inputs(mb)["labels"].tolist() == want
    assert causal_lm_inputs(mb, packed_attention="position_ids")["labels"].tolist() == want
    assert causal_lm_inputs(mb)["labels"].dtype == torch.int64
    # Padded: one sequence per row.
    padded = {k: v for k, v in mb.items() if k != "segment_ids"}
    padded["input_ids"] = torch.tensor([[a, b, c], [d, e, pad]])
    padded["labels"] = torch.tensor([[b, c, -1], [e, -1, -1]])
    padded["position_ids"] = torch.tensor([[0, 1, 2], [0, 1, 0]])
    padded["attention_mask"] = torch.tensor([[True, True, True], [True, True, False]])
    inputs = causal_lm_inputs(padded)
    assert inputs["labels"].tolist() == [[-100, b, c], [-100, e, -100]]
    assert inputs["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    # The default ignore_id is -100; a loss_mask masks further.
    assert hf_labels(torch.tensor([5, 6, -100])).tolist() == [-100, 5, 6]
    masked = {**padded, "ignore_id": -1, "loss_mask": torch.tensor([[False, True, False], [True, False, False]])}
    assert causal_lm_inputs(masked)["labels"].tolist() == [[-100, -100, c], [-100, e, -100]]


def test_varlen_by_hand() -> None:
    pytest.importorskip("transformers")
    a, b, c, d, e, f, g = 11, 12, 13, 14, 15, 16, 17
    mb = {
        "input_ids": torch.tensor([[a, b, c, 0], [d, e, f, g]]),
        "labels": torch.tensor([[b, c, -100, -100], [e, -100, g, -100]]),
        "position_ids": torch.tensor([[0, 1, 2, 0], [0, 1, 0, 1]]),
        "segment_ids": torch.tensor([[1, 1, 1, 0], [1, 1, 2, 2]], dtype=torch.int32),
        "attention_mask": torch.tensor([[True, True, True, False], [True] * 4]),
    }
    inputs = causal_lm_inputs(mb, packed_attention="varlen")
    assert set(inputs) == {
        "input_ids",
        "position_ids",
        "labels",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "use_cache",
    }
    assert inputs["input_ids"].tolist() == [[a, b, c, d, e, f, g]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert inputs["labels"].tolist() == [[-100, b, c, -100, e, -100, g]]
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert inputs[key].dtype == torch.int32 and inputs[key].tolist() == [0, 3, 5, 7]
    assert inputs["max_length_q"] == inputs["max_length_k"] == 3
    assert type(inputs["max_length_q"]) is int
    assert inputs["use_cache"] is False


# ---- 4. masks without NaN, fillers ---------------------------------------------------------


def test_mask_4d_by_hand() -> None:
    mask = packed_mask_4d(torch.tensor([[1, 1, 2, 0], [1, 0, 0, 0]]), dtype=torch.bfloat16)
    assert mask.shape == (2, 1, 4, 4) and mask.dtype == torch.bfloat16
    lo = torch.finfo(torch.bfloat16).min
    allowed = (mask[:, 0] == 0).int().tolist()
    assert allowed[0] == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    assert allowed[1] == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]  # padding: only itself
    assert set(mask.unique().tolist()) == {0.0, lo}


def test_mask_4d_gives_no_nan_with_padding(model) -> None:
    rng = np.random.default_rng(5)
    (mb,) = _microbatches(_tokens(rng, [9, 2, 3, 8, 1]), [0, 5], pack_length=10)
    assert (mb["segment_ids"] == 0).any()  # padding rows (queries) and columns (keys)
    for dtype in (torch.float32, DTYPE):
        inputs = causal_lm_inputs(mb, dtype=dtype)
        assert inputs["attention_mask"].dtype == dtype
        with torch.no_grad():
            out = copy.deepcopy(model).to(dtype)(**inputs)
        assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)


@pytest.mark.parametrize("mode", [None, *PACKED_ATTENTION])
def test_a_filler_runs_and_contributes_nothing(model, mode: str | None) -> None:
    rng = np.random.default_rng(6)
    mbs = _microbatches(_tokens(rng, [4, 5]), [0, 2, 2], pack_length=None if mode is None else 8)
    filler = mbs[1]
    assert filler["filler"] and filler["input_ids"].shape == (1, 1)
    inputs = causal_lm_inputs(filler, packed_attention=mode or "mask_4d", dtype=DTYPE)
    assert (inputs["labels"] == -100).all()
    model.zero_grad()
    out = model(**inputs)
    assert torch.isfinite(out.logits).all()
    assert torch.isnan(out.loss)  # Hugging Face's mean over no labels: skip it, or sum instead
    summed = model(**inputs, num_items_in_batch=torch.tensor(7)).loss
    assert summed.item() == 0.0
    summed.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(bool((g == 0).all()) for g in grads)
    model.zero_grad()


# ---- errors and boundaries -----------------------------------------------------------------


def test_only_model_keywords_are_passed() -> None:
    rng = np.random.default_rng(7)
    packed, padded = (_microbatches(_tokens(rng, [3, 4]), [0, 2], pack_length=p)[0] for p in (8, None))
    assert set(causal_lm_inputs(padded)) == {"input_ids", "attention_mask", "position_ids", "labels", "use_cache"}
    assert set(causal_lm_inputs(packed)) == {"input_ids", "attention_mask", "position_ids", "labels", "use_cache"}
    assert causal_lm_inputs(packed)["attention_mask"].ndim == 4


def test_a_later_pipeline_stage_has_no_inputs() -> None:
    rng = np.random.default_rng(8)
    arrays = pack(_tokens(rng, [3, 4]), max_length=8, pad_id=PAD, ignore_id=-100, dtype="int64")
    last = _from_numpy(stage_filter(arrays, stage=1, stages=2, ignore_id=-100))
    with pytest.raises(ValueError, match="'input_ids'"):
        causal_lm_inputs(last)
    padded = _microbatches(_tokens(rng, [3]), [0, 1])[0]
    del padded["attention_mask"]
    with pytest.raises(ValueError, match="'attention_mask'"):
        causal_lm_inputs(padded)


def test_bad_arguments() -> None:
    rng = np.random.default_rng(9)
    mb = _microbatches(_tokens(rng, [3, 4]), [0, 2], pack_length=8)[0]
    with pytest.raises(ValueError, match="packed_attention"):
        causal_lm_inputs(mb, packed_attention="flash")
    with pytest.raises(ValueError, match="floating"):
        causal_lm_inputs(mb, dtype=torch.int32)


def test_a_context_parallel_slice_is_refused() -> None:
    rng = np.random.default_rng(10)
    (mb,) = _microbatches(_tokens(rng, [8]), [0, 1])
    arrays = {k: v.numpy() for k, v in mb.items() if isinstance(v, torch.Tensor)}
    pads = {"input_ids": PAD, "labels": -100, "attention_mask": False, "position_ids": 0}
    first = _from_numpy(cp_slice(arrays, cp=2, rank=0, mode="contiguous", pad_values=pads))
    with pytest.raises(ValueError, match="last column"):
        causal_lm_inputs(first)


def test_importing_the_module_does_not_import_transformers() -> None:
    code = "import sys, batchplane.client.hf; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
