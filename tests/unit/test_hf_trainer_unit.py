"""batchplane.client.hf.Trainer in one process (world 1), no services: the gradient of its
training_step over a step's microbatches against sum(token cross-entropy) / global_loss_tokens
computed by hand, whatever way Hugging Face's loss is reduced (a model that takes loss kwargs,
one that does not, a compute_loss_func; average_tokens_across_devices on and off), fillers
included; the scaling formula for DDP; the refusals (gradient accumulation, an infinite job
without max_steps, max_steps past a finite job); and the step bookkeeping of a whole train() and
a resume from its checkpoint.

The data comes from `FakeClient`, a small object with the Client's interface (iteration,
len/num_steps, state_dict/load_state_dict, rank, job) serving microbatches built by the
constructor's own code (assemble, pack) and unpacked as the client does: cleaner here than a
data plane, which the integration tests (tests/integration/test_hf_trainer.py) run for real.
"""

from __future__ import annotations

import copy
import json
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from batchplane.client.hf import Trainer  # noqa: E402
from batchplane.client.hf_trainer import DATA_STATE_NAME, loss_normalizer  # noqa: E402
from batchplane.client.tensors import unpack  # noqa: E402
from batchplane.constructor.assemble import RankSamples, assemble  # noqa: E402

VOCAB = 61
PAD = 0


# ---- a client stand-in ---------------------------------------------------------------------


def build_microbatches(
    tokens: list[np.ndarray], offsets: list[int], *, global_loss_tokens: int, pack_length: int | None = None
) -> list[dict]:
    """One rank's microbatches of a step as the client yields them (see Client._fetch)."""
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
        ignore_id=-100,
        token_dtype="int32",
        global_loss_tokens=global_loss_tokens,
        pack_length=pack_length,
    )
    storage = torch.frombuffer(bytearray(built.payload), dtype=torch.uint8)
    out = []
    for layout in built.microbatches:
        mb = unpack(storage, layout.tensors)
        mb.update(
            num_tokens=layout.num_tokens,
            loss_tokens=layout.loss_tokens,
            filler=layout.filler,
            loss_weight=layout.loss_weight,
            ignore_id=-100,
        )
        out.append(mb)
    return out


def make_batch(step: int, *, seed: int, pack_length: int | None = None, filler: bool = True, extra_tokens: int = 0) -> dict:
    """A step of three microbatches (the last a filler when `filler`); global_loss_tokens counts
    this rank's targets plus `extra_tokens` (other ranks' targets, as on a real job)."""
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in rng.integers(2, 12, size=6)]
    tokens = [rng.integers(1, VOCAB, size=n).astype(np.int64) for n in lengths]
    offsets = [0, 3, 6, 6] if filler else [0, 2, 4, 6]
    total = sum(n - 1 for n in lengths) + extra_tokens
    return {
        "step": step,
        "microbatches": build_microbatches(tokens, offsets, global_loss_tokens=total, pack_length=pack_length),
        "global_loss_tokens": total,
    }


class FakeClient:
    """The Client's interface over prebuilt batches: `steps` steps, or an endless job (None)."""

    def __init__(self, steps: int | None = 4, *, global_batch_size: int = 6, pack_length: int | None = None) -> None:
        self.steps = steps
        self.rank = 0
        self.job = types.SimpleNamespace(
            job_id="fake", global_batch_size=global_batch_size, mesh=types.SimpleNamespace(dp=1, cp=1, tp=1, pp=1)
        )
        self.pack_length = pack_length
        self.next_step = 0
        self.iterations = 0  # how often iteration started
        self.yielded: list[int] = []
        self.loaded: list[dict] = []

    @property
    def num_steps(self) -> int | None:
        return self.steps

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("the batchplane job 'fake' has no len(): its data never ends (epochs: infinite)")
        return self.steps

    def __iter__(self):
        self.iterations += 1
        while self.steps is None or self.next_step < self.steps:
            step = self.next_step
            self.next_step += 1
            self.yielded.append(step)
            yield make_batch(step, seed=step, pack_length=self.pack_length)

    def state_dict(self) -> dict:
        return {"version": 3, "job": "fake", "next_step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(dict(state))
        self.next_step = state["next_step"]


# ---- models --------------------------------------------------------------------------------


def tiny_llama(attn: str = "eager") -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(config).double()


class NoLossKwargs(torch.nn.Module):
    """A model whose forward has no **kwargs: Hugging Face then gives its mean loss."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, use_cache=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels, use_cache=use_cache)


def causal_loss_func(outputs, labels, num_items_in_batch=None):
    return transformers.loss.loss_utils.ForCausalLMLoss(outputs.logits, labels, VOCAB, num_items_in_batch=num_items_in_batch)


def hand_gradient(model: torch.nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    """d/dθ of sum over microbatches of the summed cross-entropy of batchplane's pre-shifted
    labels, over global_loss_tokens: the step's exact token mean."""
    model = copy.deepcopy(model)
    model.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    for mb in batch["microbatches"]:
        if mb["filler"]:
            continue
        if "segment_ids" in mb:  # packed: attention within each document only
            from batchplane.client.hf import packed_mask_4d

            mask = packed_mask_4d(mb["segment_ids"], dtype=torch.float64)
        else:
            mask = mb["attention_mask"].long()
        logits = model(
            input_ids=mb["input_ids"].long(), attention_mask=mask, position_ids=mb["position_ids"].long(), use_cache=False
        ).logits
        total = total + F.cross_entropy(logits.flatten(0, 1), mb["labels"].long().flatten(), ignore_index=-100, reduction="sum")
    (total / batch["global_loss_tokens"]).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def make_trainer(tmp_path, model, data, **args) -> Trainer:
    kwargs = args.pop("trainer_kwargs", {})
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], **args)
    return Trainer(model=model, args=arguments, data=data, **kwargs)


# ---- the loss scaling ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "reduction,average_tokens",
    [("loss_kwargs", True), ("loss_kwargs", False), ("mean", True), ("compute_loss_func", True), ("compute_loss_func", False)],
)
@pytest.mark.parametrize("pack_length", [None, 24])
def test_training_step_gradient_is_that_of_the_steps_token_mean(tmp_path, reduction: str, average_tokens: bool, pack_length) -> None:
    llama = tiny_llama()
    model = llama if reduction == "loss_kwargs" else NoLossKwargs(llama)
    extra = {"trainer_kwargs": {"compute_loss_func": causal_loss_func}} if reduction == "compute_loss_func" else {}
    trainer = make_trainer(tmp_path, model, FakeClient(pack_length=pack_length), average_tokens_across_devices=average_tokens, **extra)
    assert trainer.model_accepts_loss_kwargs == (reduction == "loss_kwargs")
    # Other ranks' targets count in global_loss_tokens: this rank's share of the mean is less than 1.
    batch = make_batch(0, seed=3, pack_length=pack_length, extra_tokens=17)
    assert batch["microbatches"][-1]["filler"]
    expected = hand_gradient(llama, batch)

    model.zero_grad()
    loss = trainer.training_step(trainer.model, batch)
    got = {name: p.grad for name, p in llama.named_parameters()}
    assert torch.isfinite(loss) and loss.requires_grad is False
    for name, grad in expected.items():
        # Hugging Face's causal-LM loss upcasts logits with .float(): float32, not float64.
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_returned_loss_is_the_ranks_share_of_the_token_mean(tmp_path) -> None:
    model = tiny_llama()
    trainer = make_trainer(tmp_path, model, FakeClient())
    batch = make_batch(0, seed=5, extra_tokens=0)  # world 1: the rank's share is the whole mean
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for mb in batch["microbatches"]:
            if mb["filler"]:
                continue
            logits = model(input_ids=mb["input_ids"].long(), attention_mask=mb["attention_mask"].long(), use_cache=False).logits
            total += F.cross_entropy(logits.flatten(0, 1), mb["labels"].long().flatten(), ignore_index=-100, reduction="sum")
    loss = trainer.training_step(trainer.model, batch)
    assert float(loss) == pytest.approx(float(total / batch["global_loss_tokens"]), rel=1e-6)


@pytest.mark.parametrize("world,hf_factor", [(1, 1), (2, 1), (2, 2), (8, 8), (8, 1)])
def test_loss_normalizer_makes_the_ddp_average_the_token_mean(world: int, hf_factor: int) -> None:
    """Each rank back-propagates hf_factor * S_r / n; DDP averages over `world` ranks; the result
    must be sum(S_r) / T."""
    sums = [3.0 * (r + 1) for r in range(world)]  # each rank's summed token loss
    total_tokens = 37
    n = loss_normalizer(total_tokens, world=world, hf_factor=hf_factor)
    ddp_average = sum(hf_factor * s / n for s in sums) / world
    assert ddp_average == pytest.approx(sum(sums) / total_tokens)
    assert loss_normalizer(0, world=world) > 0  # a step without targets divides by something


def test_a_filler_only_step_trains_nothing_and_stays_finite(tmp_path) -> None:
    model = tiny_llama()
    trainer = make_trainer(tmp_path, model, FakeClient())
    step = make_batch(0, seed=1)
    filler = {"step": 0, "microbatches": [step["microbatches"][-1]], "global_loss_tokens": 0}
    model.zero_grad()
    loss = trainer.training_step(trainer.model, filler)
    assert float(loss) == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


# ---- refusals ------------------------------------------------------------------------------


def test_gradient_accumulation_is_refused_naming_the_microbatches(tmp_path) -> None:
    with pytest.raises(
        ValueError, match=r"gradient_accumulation_steps must be 1, got 2: each step's microbatches are its gradient accumulation"
    ):
        make_trainer(tmp_path, tiny_llama(), FakeClient(), gradient_accumulation_steps=2)


def test_an_infinite_job_needs_max_steps(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"set TrainingArguments\(max_steps=...\): .*never ends \(epochs: infinite\)"):
        make_trainer(tmp_path, tiny_llama(), FakeClient(steps=None))
    trainer = make_trainer(tmp_path, tiny_llama(), FakeClient(steps=None), max_steps=3)
    assert trainer._max_steps == 3


def test_max_steps_past_a_finite_job_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"max_steps=9 is past the end of the job's data \(4 steps\)"):
        make_trainer(tmp_path, tiny_llama(), FakeClient(steps=4), max_steps=9)


def test_other_misuses_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="train_dataset"):
        make_trainer(tmp_path, tiny_llama(), FakeClient(), trainer_kwargs={"train_dataset": [1, 2]})
    with pytest.raises(ValueError, match="packed_attention"):
        make_trainer(tmp_path, tiny_llama(), FakeClient(), trainer_kwargs={"packed_attention": "flat"})
    tp = FakeClient()
    tp.job.mesh.tp = 2
    with pytest.raises(ValueError, match="tp=2: the Hugging Face Trainer trains data-parallel only"):
        make_trainer(tmp_path, tiny_llama(), tp)
    other_rank = FakeClient()
    other_rank.rank = 1
    with pytest.raises(ValueError, match="the client reads rank 1's batches but this process is rank 0"):
        make_trainer(tmp_path, tiny_llama(), other_rank)


# ---- the loop's bookkeeping ----------------------------------------------------------------


def test_train_takes_the_jobs_steps_once_and_checkpoints_and_resumes_the_data(tmp_path) -> None:
    data = FakeClient(steps=5)
    trainer = make_trainer(tmp_path, tiny_llama(), data, save_steps=2, learning_rate=1e-3, include_num_input_tokens_seen="non_padding")
    assert trainer.args.ignore_data_skip is True
    result = trainer.train()
    assert result.global_step == 5 and data.yielded == [0, 1, 2, 3, 4]
    assert data.iterations == 1  # one epoch: Hugging Face does not start over on an exhausted client
    out = tmp_path / "out"
    for step in (2, 4, 5):  # save_steps, and the end of training
        assert json.loads((out / f"checkpoint-{step}" / DATA_STATE_NAME).read_text())["next_step"] == step
    assert trainer.state.num_input_tokens_seen > 0 and trainer.state.total_flos > 0

    again = FakeClient(steps=5)
    resumed = make_trainer(tmp_path, tiny_llama(), again, save_steps=2, learning_rate=1e-3)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert again.loaded == [{"version": 3, "job": "fake", "next_step": 2}]
    assert again.yielded == [2, 3, 4] and resumed.state.global_step == 5  # no batch skipped twice
    assert trainer.state.epoch == resumed.state.epoch == 1.0  # the whole job, also counted across the resume


def test_resume_from_a_checkpoint_without_the_data_state_is_refused(tmp_path) -> None:
    folder = tmp_path / "out" / "checkpoint-3"
    folder.mkdir(parents=True)
    trainer = make_trainer(tmp_path, tiny_llama(), FakeClient())
    with pytest.raises(ValueError, match=f"checkpoint-3 has no {DATA_STATE_NAME}"):
        trainer.train(resume_from_checkpoint=True)
