"""Built-in transforms that tokenize text and chats with a Hugging Face fast tokenizer, so that a
job needs no user code for the most common sources (see `batchplane.loader.transforms` for the
contract):

    sources:
      - {name: web, path: web/, columns: [text], transform: "batchplane.loader.hf:tokenize",
         transform_args: {tokenizer: /models/llama}}
      - {name: sft, path: sft/, columns: [messages], transform: "batchplane.loader.hf:chat",
         transform_args: {tokenizer: /models/llama}}
    batch:
      payload: [{name: assistant_mask, kind: token, dtype: uint8}]   # chat's loss mask

`tokenize(batch, *, tokenizer, text_field="text", add_bos=None, add_eos=True, tokenizer_args=None)`
turns the string column `text_field` into `input_ids`: the text's own tokens
(`tokenizer(text, add_special_tokens=False)`), then
- `add_bos` null (the default): the leading special tokens the tokenizer itself adds with
  `add_special_tokens=True` (Llama's `<s>`; none for GPT-2 or Qwen, which train without one),
  so a model gets the documents as it was trained on them; true: exactly the tokenizer's
  `bos_token`; false: none;
- `add_eos` true (the default): exactly the tokenizer's `eos_token` at the end, instead of any
  trailing special tokens of its own. A pretraining corpus wants it: samples are concatenated
  (packing, splitting) or end where a document ends, and EOS is how the model learns that a
  document is over (Megatron-LM's `--append-eod` and torchtitan's HF datasets do the same),
  whereas few tokenizers append it themselves. Null: the tokenizer's own trailing special
  tokens (what `add_special_tokens=True` gives); false: none.
With `add_bos` and `add_eos` both null the ids are exactly `tokenizer(text)["input_ids"]`.
A null or non-string value, and a text with no tokens of its own (empty), is a rejected sample
(a null list), never an error.

`chat(batch, *, tokenizer, messages_field="messages", mask_field="assistant_mask",
mask_end_of_turn=True, mask_alignment="tokens", chat_template=None, template_args=None,
tokenizer_args=None)` renders the list column `messages_field` (each a list of
`{role, content}` structs, as pyarrow reads them from JSON or Parquet) with the tokenizer's chat
template, so `input_ids` are exactly `tokenizer.apply_chat_template(messages)["input_ids"]`,
and returns beside it `mask_field` (None: no mask), a per-token uint8 column: 1 on the tokens of
the assistant turns, 0 on system, user and tool turns and on the template's scaffolding (role
headers, generation prompts). Declare it in `batch.payload` as a "token" column (any dtype: a
float32 one gives a loss scale of 0 or 1); it is cut, padded, packed and CP-sliced like
`input_ids`. A value that is not a non-empty list of messages, each a mapping with a string
`role` and a string `content`, a conversation the template refuses (`raise_exception`), and one
whose assistant text cannot be found in the rendering, are rejected samples of their own; one
without an assistant turn is delivered with a mask of zeros.
- `mask_end_of_turn` (true): the special token the template writes right after an assistant
  turn's content, within that turn (ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`, `</s>`),
  is masked 1 too: it is what the model must learn to generate to stop;
- `mask_alignment` "tokens" (the default): value t belongs to token t, as Hugging Face's
  `assistant_masks`. The constructor's `labels[t]` is token t + 1, so the loss at t counts
  where mask[t + 1] is 1; with context parallelism a rank cannot look one token past its slice,
  so "labels" delivers that shifted mask instead: value t is mask[t + 1] of the same sample (0
  at its last token), aligned with `labels` on every CP slice, chunk and packed row;
- `chat_template`: a Jinja template (or a named one of the tokenizer) instead of its default;
  `template_args`: extra variables for it (e.g. `{enable_thinking: false}`).

How the mask is found: with a template that marks what the model generates with
`{% generation %}`, by the template itself (`return_assistant_tokens_mask`, Hugging Face's
rule; `mask_end_of_turn` does not apply). Otherwise, on any plain template, by rendering. For
assistant message i, its turn starts where the rendering of `messages[:i]` with the generation
prompt ends (when the full rendering starts with it), or else where a placeholder content lands
in a rendering of `messages[:i + 1]` (the first message has no prompt to render); the turn ends
where the rendering of `messages[:i + 1]` ends (when the full one starts with it). The content
must begin where the turn starts (as it is, or without surrounding whitespace for templates that
`trim`), or else lie within the turn; its characters, with the turn's closing special token, are
the assistant's (the closing token only where the turn's end is known). A token is masked when its characters overlap the assistant's (the rule of
`return_assistant_tokens_mask`, so a token that merges a header's newline with leading
whitespace of the content is trained). The text is tokenized once, as a whole, so the ids are
the template's exactly. Limits: content must be a string (a list of content parts, or an
assistant message with only `tool_calls`, is rejected); a sample whose turns cannot be placed
for certain (a template that rewrites the content beyond trimming, or whose renderings are not
prefixes of one another) is rejected, never wrongly masked; the role is "assistant" exactly;
the generation-marked path runs Hugging Face's own per-token loop over the offsets.

The tokenizer (`tokenizer`: a local folder with a `tokenizer.json`, or a Hub name; relative
folders are relative to the loader's working directory) is loaded once per process for each
(tokenizer, `tokenizer_args`) pair (`load_tokenizer`) as a `transformers.PreTrainedTokenizerFast`
(not `AutoTokenizer`, which imports torch where it is installed: service processes never do).
`tokenizer_args` go to `from_pretrained` (e.g. `{revision: main, local_files_only: true}`).
transformers is imported on first use only, so importing this module costs nothing.

What this module must not do: apply `batch.max_length` (the loader does, right after the
transform), or loop in Python over tokens (each row group is one batched tokenizer call; the
Arrow columns are built from flat NumPy arrays).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

#: Where a chat template marks the text the model generates.
_GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
#: Texts whose tokens show which special tokens a tokenizer adds around a text's own.
_PROBES = ("a", "Hello world", "0", ".")
_MASK_ALIGNMENTS = ("tokens", "labels")
#: Stands for an assistant message's content in the rendering that finds where it goes.
_PLACEHOLDER = "\ue000batchplane-content\ue001"
_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class _Loaded:
    """A loaded tokenizer and what the transforms derive from it once."""

    #: The transformers tokenizer (a PreTrainedTokenizerFast).
    tokenizer: Any
    #: The special tokens its `add_special_tokens=True` puts before and after a text's own.
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    #: The text of its special added tokens, longest first.
    specials: tuple[str, ...]


def load_tokenizer(tokenizer: str, tokenizer_args: Mapping[str, Any] | None = None) -> Any:
    """The Hugging Face fast tokenizer `tokenizer` (a local folder or a Hub name), loaded once
    per process for each (tokenizer, tokenizer_args).

    Args:
        tokenizer: A folder holding `tokenizer.json` (and `tokenizer_config.json`), or a name.
        tokenizer_args: Keyword arguments of `PreTrainedTokenizerFast.from_pretrained`.
    Returns:
        The `transformers.PreTrainedTokenizerFast`, shared by every caller: do not change it.
    Raises:
        ValueError: `tokenizer` is not a non-empty string.
        OSError: it cannot be found or read (transformers' errors).
    """
    return _loaded(tokenizer, tokenizer_args).tokenizer


def tokenize(
    batch: pa.Table,
    *,
    tokenizer: str,
    text_field: str = "text",
    add_bos: bool | None = None,
    add_eos: bool | None = True,
    tokenizer_args: Mapping[str, Any] | None = None,
) -> pa.Table:
    """Tokenizes the text column `text_field`: `input_ids` list<int32>, one list per row (see
    the module docstring for the options and their defaults).

    Raises:
        ValueError: the table has no column `text_field`, an option of the wrong type, or
            add_bos / add_eos true for a tokenizer without a bos / eos token.
    """
    _check_flag("add_bos", add_bos)
    _check_flag("add_eos", add_eos)
    loaded = _loaded(tokenizer, tokenizer_args)
    prefix = loaded.prefix if add_bos is None else _special(loaded, "bos") if add_bos else ()
    suffix = loaded.suffix if add_eos is None else _special(loaded, "eos") if add_eos else ()
    texts = _column(batch, text_field).to_pylist()
    valid = np.fromiter((isinstance(t, str) for t in texts), bool, count=len(texts))
    backend = _backend(loaded)
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # the same ids, no offsets
    encodings = encode([t for t, ok in zip(texts, valid) if ok], add_special_tokens=False)
    ids, lengths = _flatten([e.ids for e in encodings], np.int32)
    counts = np.zeros(len(texts), np.int64)
    counts[valid] = lengths
    return pa.table({"input_ids": _framed(ids, counts, prefix=prefix, suffix=suffix)})


def chat(
    batch: pa.Table,
    *,
    tokenizer: str,
    messages_field: str = "messages",
    mask_field: str | None = "assistant_mask",
    mask_end_of_turn: bool = True,
    mask_alignment: str = "tokens",
    chat_template: str | None = None,
    template_args: Mapping[str, Any] | None = None,
    tokenizer_args: Mapping[str, Any] | None = None,
) -> pa.Table:
    """Renders the conversations of `messages_field` with the chat template: `input_ids`
    list<int32> and, unless `mask_field` is None, the assistant-token mask list<uint8> named
    `mask_field` (see the module docstring).

    Raises:
        ValueError: the table has no column `messages_field`, an option of the wrong type or
            value, or a tokenizer without a chat template (and none given).
    """
    _check_flag("mask_end_of_turn", mask_end_of_turn, optional=False)
    if mask_alignment not in _MASK_ALIGNMENTS:
        raise ValueError(f"transform_args.mask_alignment must be one of {', '.join(_MASK_ALIGNMENTS)}, got {mask_alignment!r}")
    if mask_field is not None and not isinstance(mask_field, str):
        raise ValueError(f"transform_args.mask_field must be a column name or null, got {mask_field!r}")
    if template_args is not None and not isinstance(template_args, Mapping):
        raise ValueError(f"transform_args.template_args must be a mapping, got {template_args!r}")
    loaded = _loaded(tokenizer, tokenizer_args)
    try:
        template = loaded.tokenizer.get_chat_template(chat_template)
    except ValueError as exc:
        raise ValueError(f"tokenizer {tokenizer!r}: {exc}") from None
    renderer = _Renderer(loaded.tokenizer, template, dict(template_args or {}))
    conversations = [_conversation(value) for value in _column(batch, messages_field).to_pylist()]
    if _GENERATION_MARK.search(template):
        ids, masks = renderer.generated(conversations)
    else:
        ids, masks = _marked(loaded, renderer, conversations, end_of_turn=mask_end_of_turn)
    good = [i for i, got in enumerate(ids) if got is not None]
    flat_ids, lengths = _flatten([ids[i] for i in good], np.int32)
    counts = np.zeros(len(conversations), np.int64)
    counts[good] = lengths
    columns = {"input_ids": _framed(flat_ids, counts)}
    if mask_field is not None:
        flat_mask, _ = _flatten([masks[i] for i in good], np.uint8)
        if mask_alignment == "labels":
            flat_mask = _shifted(flat_mask, lengths)
        columns[mask_field] = _framed(flat_mask, counts, value_type=pa.uint8())
    return pa.table(columns)


# ---- loading ---------------------------------------------------------------------------------


def _loaded(tokenizer: str, tokenizer_args: Mapping[str, Any] | None) -> _Loaded:
    if not isinstance(tokenizer, str) or not tokenizer:
        raise ValueError(f"transform_args.tokenizer must be a folder or a name, got {tokenizer!r}")
    if tokenizer_args is not None and not isinstance(tokenizer_args, Mapping):
        raise ValueError(f"transform_args.tokenizer_args must be a mapping, got {tokenizer_args!r}")
    key = json.dumps(dict(tokenizer_args or {}), sort_keys=True, default=repr)
    with _LOCK:  # two sources' readers asking at once load it once
        return _load(tokenizer, key)


@functools.lru_cache(maxsize=None)
def _load(tokenizer: str, tokenizer_args: str) -> _Loaded:
    from transformers import PreTrainedTokenizerFast

    loaded = PreTrainedTokenizerFast.from_pretrained(tokenizer, **json.loads(tokenizer_args))
    specials = sorted({str(t.content) for t in loaded.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
    out = _Loaded(loaded, (), (), tuple(s for s in specials if s))
    prefix, suffix = _added_around(_backend(out))
    return dataclasses.replace(out, prefix=prefix, suffix=suffix)


def _backend(loaded: _Loaded) -> Any:
    """The tokenizer's Rust tokenizer set as `tokenizer(texts)` sets it on every call: no
    truncation or padding (a tokenizer.json, or a caller of `load_tokenizer`, may enable
    them), special tokens in the text read as special tokens unless the tokenizer splits them."""
    backend = loaded.tokenizer.backend_tokenizer
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    split = bool(getattr(loaded.tokenizer, "split_special_tokens", False))
    if backend.encode_special_tokens != split:
        backend.encode_special_tokens = split
    return backend


def _added_around(backend: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids the tokenizer's post-processor adds before and after a text's own tokens."""
    for probe in _PROBES:
        own = backend.encode(probe, add_special_tokens=False).ids
        full = backend.encode(probe, add_special_tokens=True).ids
        if not own:
            continue
        for at in range(len(full) - len(own) + 1):
            if full[at : at + len(own)] == own:
                return tuple(full[:at]), tuple(full[at + len(own) :])
    return (), ()


def _special(loaded: _Loaded, which: str) -> tuple[int, ...]:
    token_id = getattr(loaded.tokenizer, f"{which}_token_id", None)
    if token_id is None:
        raise ValueError(f"transform_args.add_{which} is true, but the tokenizer has no {which}_token")
    return (int(token_id),)


def _check_flag(name: str, value: object, *, optional: bool = True) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        raise ValueError(f"transform_args.{name} must be true or false{' or null' if optional else ''}, got {value!r}")


def _column(batch: pa.Table, name: str) -> pa.ChunkedArray:
    if not isinstance(name, str) or batch.schema.get_field_index(name) < 0:
        raise ValueError(f"no column {name!r} to tokenize (columns: {', '.join(batch.schema.names)}); read it with sources[].columns")
    return batch.column(name)


# ---- chats -----------------------------------------------------------------------------------


def _conversation(value: object) -> list[dict[str, Any]] | None:
    """A sample's messages as the template gets them (struct fields that are null left out, as
    transformers does), or None when it is not a non-empty list of messages each with a
    string role and content."""
    if not isinstance(value, list) or not value:
        return None
    messages = []
    for message in value:
        if not isinstance(message, Mapping):
            return None
        message = {k: v for k, v in message.items() if v is not None}
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            return None
        messages.append(message)
    return messages


class _Renderer:
    """Renders conversations with one template; a conversation the template refuses is None."""

    def __init__(self, tokenizer: Any, template: str, template_args: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.args = template_args

    def text(self, messages: list[dict[str, Any]], *, prompt: bool = False) -> str | None:
        try:
            out = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt, chat_template=self.template, **self.args
            )
        except Exception:  # noqa: BLE001 - the template's raise_exception, or any error of user data
            return None
        return out if isinstance(out, str) else None

    def generated(self, conversations: Sequence[list[dict[str, Any]] | None]) -> tuple[list[Any], list[Any]]:
        """Ids and `return_assistant_tokens_mask` masks of a template with generation marks:
        one batched call, or one call per conversation when the batch fails (a conversation the
        template refuses is then rejected alone)."""
        ids: list[Any] = [None] * len(conversations)
        masks: list[Any] = [None] * len(conversations)
        good = [i for i, c in enumerate(conversations) if c is not None]
        try:
            groups = [(good, self._generated([conversations[i] for i in good]))]
        except Exception:  # noqa: BLE001 - the template's raise_exception, or any error of user data
            groups = []
            for i in good:
                try:
                    groups.append(([i], self._generated([conversations[i]])))
                except Exception:  # noqa: BLE001
                    continue
        for index, (got_ids, got_masks) in groups:
            for i, one_ids, one_mask in zip(index, got_ids, got_masks):
                ids[i], masks[i] = one_ids, one_mask
        return ids, masks

    def _generated(self, conversations: list[Any]) -> tuple[list[list[int]], list[list[int]]]:
        if not conversations:
            return [], []
        out = self.tokenizer.apply_chat_template(
            conversations,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            chat_template=self.template,
            **self.args,
        )
        return out["input_ids"], out["assistant_masks"]


def _marked(
    loaded: _Loaded, renderer: _Renderer, conversations: Sequence[list[dict[str, Any]] | None], *, end_of_turn: bool
) -> tuple[list[Any], list[Any]]:
    """Ids and assistant masks of conversations on a template without generation marks: each
    rendered and searched for its assistant text (`_assistant_spans`), then all tokenized in
    one batched call and masked by character spans (`_overlapping`)."""
    texts: list[str] = []
    spans: list[list[tuple[int, int]]] = []
    index: list[int] = []
    for i, messages in enumerate(conversations):
        if messages is None:
            continue
        text = renderer.text(messages)
        if text is None:
            continue
        found = _assistant_spans(renderer, messages, text, specials=loaded.specials if end_of_turn else ())
        if found is None:
            continue
        texts.append(text)
        spans.append(found)
        index.append(i)
    encodings = _backend(loaded).encode_batch(texts, add_special_tokens=False)
    mask = _overlapping([e.offsets for e in encodings], spans, [len(t) for t in texts])
    ids: list[Any] = [None] * len(conversations)
    masks: list[Any] = [None] * len(conversations)
    bounds = np.zeros(len(encodings) + 1, np.int64)
    np.cumsum([len(e) for e in encodings], out=bounds[1:])
    for k, (i, encoding) in enumerate(zip(index, encodings)):
        ids[i] = encoding.ids
        masks[i] = mask[bounds[k] : bounds[k + 1]]
    return ids, masks


def _assistant_spans(
    renderer: _Renderer, messages: list[dict[str, Any]], text: str, *, specials: Sequence[str]
) -> list[tuple[int, int]] | None:
    """The character spans [start, end) of `text` (the rendering of `messages`) that the
    assistant turns' content and closing special tokens take, in order; None when a turn's
    place or content cannot be found for certain (see the module docstring)."""
    spans: list[tuple[int, int]] = []
    done = 0  # where the previous assistant text ended
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _turn_start(renderer, messages, i, text)
        if start is None or start < done:
            return None
        through = renderer.text(messages[: i + 1])
        end = len(through) if through is not None and text.startswith(through) and len(through) >= start else None
        found = _content_at(text, message["content"], start, end)
        if found is None:
            return None
        at, stop = found
        if end is not None:  # the turn's closing special token, after the template's whitespace
            gap = len(text[stop:end]) - len(text[stop:end].lstrip())
            closing = next((s for s in specials if text.startswith(s, stop + gap) and stop + gap + len(s) <= end), None)
            if closing is not None:
                stop += gap + len(closing)
        spans.append((at, stop))
        done = stop
    return spans


def _turn_start(renderer: _Renderer, messages: list[dict[str, Any]], i: int, text: str) -> int | None:
    """Where assistant message i's content may start in `text`: the end of the conversation
    before it rendered with the generation prompt, or else where a placeholder content lands
    in the conversation through it; None when `text` starts with neither rendering."""
    if i:
        before = renderer.text(messages[:i], prompt=True)
        if before is not None and text.startswith(before):
            return len(before)
    probe = renderer.text([*messages[:i], {**messages[i], "content": _PLACEHOLDER}])
    if probe is None:
        return None
    at = probe.rfind(_PLACEHOLDER)
    return at if at >= 0 and text.startswith(probe[:at]) else None


def _content_at(text: str, content: str, start: int, end: int | None) -> tuple[int, int] | None:
    """Where `content` (or, for a template that trims it, its stripped text) is in `text`: at
    `start`, or else within [start, end) when the turn's end is known."""
    candidates = dict.fromkeys((content, content.strip()))
    for candidate in candidates:
        if text.startswith(candidate, start):
            return start, start + len(candidate)
    for candidate in candidates if end is not None else ():
        at = text.find(candidate, start, end)
        if at >= 0:
            return at, at + len(candidate)
    return None


def _overlapping(
    offsets: Sequence[Sequence[tuple[int, int]]], spans: Sequence[Sequence[tuple[int, int]]], sizes: Sequence[int]
) -> np.ndarray:
    """uint8 [Σ tokens]: 1 for a token whose characters [start, end) overlap one of its text's
    spans (start < span end and end > span start, `return_assistant_tokens_mask`'s rule), for
    every text at once: each text's positions are moved past the previous texts' so that one
    sorted search over all spans serves them all."""
    base = np.zeros(len(sizes), np.int64)
    np.cumsum(np.asarray(sizes[:-1], np.int64) + 1, out=base[1:])
    tokens = _pairs(offsets) + np.repeat(base, [len(o) for o in offsets])[:, None]
    marked = _pairs(spans) + np.repeat(base, [len(s) for s in spans])[:, None]
    marked = marked[marked[:, 1] > marked[:, 0]]  # an empty span masks nothing
    if not len(marked) or not len(tokens):
        return np.zeros(len(tokens), np.uint8)
    first = np.searchsorted(marked[:, 1], tokens[:, 0], side="right")  # the first span ending after the token's start
    found = first < len(marked)
    hit = np.zeros(len(tokens), bool)
    hit[found] = marked[first[found], 0] < tokens[found, 1]
    return hit.astype(np.uint8)


def _pairs(nested: Sequence[Sequence[tuple[int, int]]]) -> np.ndarray:
    """int64 [Σ pairs, 2]: every text's (start, end) pairs, one text after another."""
    flat = itertools.chain.from_iterable(itertools.chain.from_iterable(nested))
    return np.fromiter(flat, np.int64, count=2 * sum(map(len, nested))).reshape(-1, 2)


# ---- Arrow columns ---------------------------------------------------------------------------


def _flatten(lists: Sequence[Sequence[int]], dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """The lists' values concatenated (`dtype`) and their lengths (int64), without a Python
    loop over the values."""
    lengths = np.fromiter(map(len, lists), np.int64, count=len(lists))
    values: np.ndarray = np.fromiter(itertools.chain.from_iterable(lists), dtype, count=int(lengths.sum()))
    return values, lengths


def _framed(
    values: np.ndarray, counts: np.ndarray, *, prefix: Iterable[int] = (), suffix: Iterable[int] = (), value_type: pa.DataType | None = None
) -> pa.ListArray:
    """A list array of len(counts) rows: row i holds `prefix`, its counts[i] values (taken in
    order from `values`) and `suffix`; a row of no values is null (a rejected sample)."""
    head, tail = np.asarray(tuple(prefix), values.dtype), np.asarray(tuple(suffix), values.dtype)
    good = counts > 0
    sizes = np.where(good, counts + len(head) + len(tail), 0)
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError(f"{int(offsets[-1])} tokens in one row group; at most 2**31 - 1")
    if len(head) or len(tail):
        out = np.empty(int(offsets[-1]), values.dtype)
        starts = offsets[:-1][good]
        rank = np.repeat(np.arange(len(starts), dtype=np.int64) * (len(head) + len(tail)) + len(head), counts[good])
        out[np.arange(len(values), dtype=np.int64) + rank] = values
        for k, token in enumerate(head):
            out[starts + k] = token
        for k, token in enumerate(tail):
            out[offsets[1:][good] - len(tail) + k] = token
        values = out
    array = pa.array(values, type=value_type) if value_type is not None else pa.array(values)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), array, mask=pa.array(~good))


def _shifted(mask: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each sample's mask moved one token left (value t becomes mask[t + 1]), 0 at its last
    token: aligned with the constructor's labels."""
    out = np.zeros_like(mask)
    out[:-1] = mask[1:]
    ends = np.cumsum(counts) - 1
    out[ends[counts > 0]] = 0
    return out
