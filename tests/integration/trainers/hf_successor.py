"""A trainer run by tests/integration/test_hf_trainer.py under torchrun (one process per rank,
gloo on CPU): a tiny random Llama trained through `batchplane.client.hf.Trainer` on the job
named by BATCHPLANE_ENDPOINTS.

    torchrun --standalone --nproc_per_node 2 hf_successor.py --out DIR --vocab 64 [--save-steps K]
        [--resume] [--steps-log NAME] [--stall-after-step S] [--grad-check]

Writes under DIR:
- `NAME-rank{r}.jsonl`: one line per step this rank trained, flushed at once: the step, the
  global step Hugging Face counts, each microbatch's sample ids (source, row) and a SHA-256 of
  every tensor's bytes, and the loss the step back-propagated;
- `pid-rank{r}`: the process id (torchrun starts each worker in a session of its own, so a test
  that kills "the whole trainer" kills these too);
- `hf/`: Hugging Face's output_dir (checkpoints, with batchplane_data.json);
- `final/`: the trained model (save_pretrained), after the last step;
- `ended-rank{r}.json`: the global step training ended at, the job's length as the client knows
  it then (`num_steps`) and whether it knows its data ended;
- with --grad-check, `gradcheck-rank{r}.pt`: step 0's microbatches, the parameters before it
  and the gradients after its last backward (after DDP's all-reduce).
With --stall-after-step S, rank 0 stops after logging step S and waits to be killed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import time

import torch
import transformers

from batchplane.client.hf import Trainer


def tiny_llama(vocab: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:32]


class LoggedTrainer(Trainer):
    """Logs every step it trains (see the module docstring)."""

    def __init__(self, *args, log_path: pathlib.Path, out: pathlib.Path, stall_after: int | None, grad_check: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 - closed at exit
        self._out = out
        self._stall_after = stall_after
        self._grad_check = grad_check

    def training_step(self, model, inputs, num_items_in_batch=None):
        rank = self.args.process_index
        check = self._grad_check and inputs["step"] == 0
        if check:
            before = {k: v.detach().clone() for k, v in self.model.named_parameters()}
        loss = super().training_step(model, inputs, num_items_in_batch)
        if check:
            torch.save(
                {
                    "parameters": before,
                    "gradients": {k: v.grad.detach().clone() for k, v in self.model.named_parameters()},
                    "global_loss_tokens": inputs["global_loss_tokens"],
                    # (the client's tensors are views of one buffer: saved as copies)
                    "microbatches": [
                        {k: v.clone() for k, v in mb.items() if isinstance(v, torch.Tensor)} | {"filler": mb["filler"]}
                        for mb in inputs["microbatches"]
                    ],
                },
                self._out / f"gradcheck-rank{rank}.pt",
            )
        line = {
            "step": inputs["step"],
            "global_step": self.state.global_step,
            "samples": [list(zip(mb["sample_source"].tolist(), mb["sample_row"].tolist())) for mb in inputs["microbatches"]],
            "hashes": [{k: digest(v) for k, v in sorted(mb.items()) if isinstance(v, torch.Tensor)} for mb in inputs["microbatches"]],
            "loss": float(loss),
        }
        self._log.write(json.dumps(line) + "\n")
        self._log.flush()
        if self._stall_after is not None and rank == 0 and inputs["step"] >= self._stall_after:
            while True:  # killed here by the test
                time.sleep(1)
        return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--save-steps", type=int, default=0, help="0: save_strategy 'no'")
    parser.add_argument("--resume", action="store_true", help="train(resume_from_checkpoint=True)")
    parser.add_argument("--steps-log", default="steps", help="the name of the per-rank step logs")
    parser.add_argument("--stall-after-step", type=int, default=None)
    parser.add_argument("--grad-check", action="store_true")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    options = parser.parse_args()
    rank = int(os.environ["RANK"])
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / f"pid-rank{rank}").write_text(str(os.getpid()))

    args = transformers.TrainingArguments(
        output_dir=str(options.out / "hf"),
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        learning_rate=options.learning_rate,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        logging_steps=10,
        save_strategy="steps" if options.save_steps else "no",
        save_steps=options.save_steps or 500,
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=0,
    )
    trainer = LoggedTrainer(
        model=tiny_llama(options.vocab),
        args=args,
        log_path=options.out / f"{options.steps_log}-rank{rank}.jsonl",
        out=options.out,
        stall_after=options.stall_after_step,
        grad_check=options.grad_check,
    )
    trainer.train(resume_from_checkpoint=True if options.resume else None)
    ended = {"global_step": trainer.state.global_step, "num_steps": trainer.data.num_steps, "ended": trainer.data.ended}
    (options.out / f"ended-rank{rank}.json").write_text(json.dumps(ended))
    trainer.save_model(str(options.out / "final"))
    trainer.data.close()


if __name__ == "__main__":
    main()
