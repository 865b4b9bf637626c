"""torchtitan's training step, checkpointer and debug Llama on CPU over `BatchplaneDataLoader`
(tests/integration/test_torchtitan.py runs it under `torchrun --nproc_per_node 2`, gloo).

torchtitan 0.3.0's `Trainer.__init__` cannot run on a CPU-only machine: with no accelerator,
`torchtitan.tools.utils.device_type` falls back to "cuda" and `__init__` calls
`torch.cuda.set_device`, which a CPU build of torch does not have; past that it builds its
DeviceMesh on "cuda" (NCCL), its metrics on CUDA memory statistics, its model with FlexAttention
(no backward on CPU) and lowers the process groups' timeouts with a CUDA barrier. So this script
builds what `__init__` builds, on CPU, into a `Trainer` made with `object.__new__`, and runs
torchtitan's own code on it: `Trainer.train_step` (which pulls gradient_accumulation_steps
microbatches with `next()`, counts IGNORE_INDEX labels, all-reduces the token count, runs
`forward_backward_step` -> `post_dataloading_process` -> the model and torchtitan's
cross-entropy, clips and steps), `Trainer.batch_generator` (StopIteration ->
DataloaderExhaustedError) and the `CheckpointManager` (DCP), in a copy of `Trainer.train`'s loop
without its profiler, GC handler and timeout change. Real: the Trainer.Config, the dataloader
built by `config.dataloader.build(...)` with the Trainer's arguments, torchtitan's debug Llama
(6 layers; its inner attention set to SDPA, causal, as torchtitan's graph-trainer tests do),
OptimizersContainer (AdamW), LRSchedulersContainer, CrossEntropyLoss, CheckpointManager.
Stand-ins: DDP over gloo instead of torchtitan's parallelize_llama, a ParallelDims exposing one
gloo mesh as "batch" and "loss", a metrics processor that records the loss.

torchtitan.trainer and torchtitan.models import torchtitan's expert-parallel Triton kernels
(torchtitan.distributed.minimal_async_ep.kernels) at module import; a CPU build of torch has no
triton, so an inert module stands in for that one module (the debug Llama has no experts; none
of it runs).

`--end-with-data` mixes batchplane's `EndWithData` into the Trainer. `--stop-after N` leaves after step N with the config unchanged (training.steps drives the LR
schedule), as a job that died there. `--reference ENDPOINTS DUMP OUT` first trains, in the same
ranks, the whole job of another data plane from the same seed, uninterrupted: the run the test
compares with (one torchrun, one import of torch and torchtitan per rank, for two runs). Per
torchtitan step, rank 0 and 1 each append a JSON line to `<out>/rank<r>.jsonl`: the step, the
loader's position after it (batchplane's next step), a hash of each (input_dict, labels) pair
pulled and torchtitan's global loss.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import sys
import types

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _stand_in_for_the_triton_kernels() -> None:
    class Inert:
        def __call__(self, *args: object, **kwargs: object) -> Inert:
            return self

        def __getattr__(self, name: str) -> Inert:
            if name.startswith("__"):
                raise AttributeError(name)
            return self

    inert = Inert()
    module = types.ModuleType(_KERNELS)

    def getattr_(name: str) -> Inert:
        if name.startswith("__"):
            raise AttributeError(name)
        return inert

    module.__getattr__ = getattr_
    sys.modules.setdefault(_KERNELS, module)


try:
    import triton  # noqa: F401
except ImportError:
    _stand_in_for_the_triton_kernels()

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.dataloader import DataloaderExhaustedError  # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from batchplane.client.torchtitan import BatchplaneDataLoader, EndWithData  # noqa: E402


class ParallelDims:
    """What Trainer.train_step asks of torchtitan's ParallelDims, over one gloo mesh of the
    data-parallel ranks (torchtitan's own builds its meshes on CUDA)."""

    def __init__(self, world: int) -> None:
        self.mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("batch",))
        self.dp_enabled = self.dp_cp_enabled = world > 1
        self.cp_enabled = self.pp_enabled = self.ep_enabled = False

    def get_mesh(self, name: str):
        assert name == "batch", name
        return self.mesh

    def get_optional_mesh(self, name: str):
        return self.mesh if name == "loss" else None


class Metrics:
    """Records torchtitan's global loss per step instead of logging it."""

    def __init__(self) -> None:
        self.ntokens_since_last_log = 0
        self.data_loading_times: list[float] = []
        self.losses: dict[int, float] = {}

    def should_log(self, step: int) -> bool:
        return True

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float, extra_metrics: dict | None = None) -> None:
        self.losses[step] = global_avg_loss


def pair_hash(input_dict: dict[str, torch.Tensor], labels: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for name, t in sorted({**input_dict, "labels": labels}.items()):
        t = t.contiguous()
        digest.update(f"{name}{t.dtype}{tuple(t.shape)}".encode() + t.numpy().tobytes())
    return digest.hexdigest()[:16]


class EndingTrainer(EndWithData, Trainer):
    """torchtitan's Trainer ending with the job's data, its last step saved (`EndWithData`)."""


def build_trainer(args: argparse.Namespace, rank: int, world: int, dump: pathlib.Path) -> Trainer:
    spec = model_registry("debugmodel", attn_backend="flex")
    for _, _, parent, attr in spec.model.traverse(FlexAttention.Config):
        setattr(parent, attr, ScaledDotProductAttention.Config())  # FlexAttention has no CPU backward
    config = Trainer.Config(
        model_spec=spec,
        dump_folder=str(dump),
        loss=CrossEntropyLoss.Config(),
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=2, global_batch_size=8, seq_len=64, steps=args.steps, disable_cuda_graphs=True),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(
            enable=True, folder="checkpoint", interval=args.interval, last_save_model_only=False, keep_latest_k=0, load_step=args.load_step
        ),
        # As torchtitan's train_step takes them: gradient_accumulation_steps x PP microbatches.
        dataloader=BatchplaneDataLoader.Config(microbatches_per_step=8 // (2 * world), timeout_s=60),
    )
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)

    trainer = object.__new__(EndingTrainer if args.end_with_data else Trainer)  # Trainer.__init__ needs CUDA; what it sets, on CPU:
    trainer.config = config
    trainer.device = torch.device("cpu")
    trainer.parallel_dims = ParallelDims(world)
    trainer.model_config = spec.model
    torch.manual_seed(0)
    model = spec.model.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    trainer.model_parts = [DistributedDataParallel(model)]
    trainer.metrics_processor = Metrics()
    trainer.loss_fn = config.loss.build(compile_config=CompileConfig())
    trainer.gradient_accumulation_steps = config.training.global_batch_size // (config.training.local_batch_size * world)
    trainer.num_pipeline_parallel_microbatches = 1
    trainer.optimizers = config.optimizer.build(model_parts=trainer.model_parts)
    trainer.lr_schedulers = config.lr_scheduler.build(optimizers=trainer.optimizers, training_steps=config.training.steps)
    trainer.step = 0
    trainer.ntokens_seen = 0
    trainer.dataloader = config.dataloader.build(  # the call Trainer.__init__ makes
        dp_world_size=world,
        dp_rank=rank,
        tokenizer=None,
        seq_len=config.training.seq_len,
        local_batch_size=config.training.local_batch_size,
        snapshot_every_n_steps=config.checkpoint.interval * trainer.gradient_accumulation_steps,
    )
    trainer.checkpointer = config.checkpoint.build(
        dataloader=trainer.dataloader,
        model_parts=trainer.model_parts,
        optimizers=trainer.optimizers,
        lr_schedulers=trainer.lr_schedulers,
        states={"train_state": trainer},
        sd_adapter=None,
        base_folder=config.dump_folder,
    )
    trainer.train_context = dist_utils.get_spmd_context(parallel_dims=None)
    trainer.fwd_bwd_fn = trainer._forward_backward_body
    return trainer


def train(args: argparse.Namespace, rank: int, world: int, *, dump: pathlib.Path, out: pathlib.Path, stop_after: int | None) -> None:
    """One run of the job at BATCHPLANE_ENDPOINTS: from `dump`'s latest checkpoint (if any) to the
    end of data, `args.steps` or `stop_after`; per step a line in `out`/rank<r>.jsonl, at the end
    `out`/done<r>.json."""
    out.mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(args, rank, world, dump)
    loader = trainer.dataloader
    pulled: list[str] = []

    def recorded(pairs):
        for input_dict, labels in pairs:
            pulled.append(pair_hash(input_dict, labels))
            yield input_dict, labels

    # Trainer.train, without the profiler, the GC handler and set_pg_timeouts (a CUDA barrier).
    trainer.checkpointer.load(step=trainer.config.checkpoint.load_step)
    loaded = {"step": trainer.step, "position": loader.state_dict()[f"dp_rank_{rank}"]}
    exhausted_at = None
    data_iterator = recorded(trainer.batch_generator(trainer.dataloader))
    with open(out / f"rank{rank}.jsonl", "a") as lines:
        while trainer.should_continue_training():
            trainer.step += 1
            pulled.clear()
            try:
                trainer.train_step(data_iterator)
            except DataloaderExhaustedError:
                exhausted_at = trainer.step
                break
            trainer.checkpointer.save(trainer.step, last_step=(trainer.step == trainer.config.training.steps))
            position = loader.state_dict()[f"dp_rank_{rank}"]
            line = {
                "step": trainer.step,
                "next_step": position["next_step"],
                "microbatch": position["microbatch"],
                "pairs": list(pulled),
                "loss": trainer.metrics_processor.losses[trainer.step],
            }
            lines.write(json.dumps(line) + "\n")
            lines.flush()
            if trainer.step == stop_after:
                break
    (out / f"done{rank}.json").write_text(json.dumps({"loaded": loaded, "exhausted_at": exhausted_at, "step": trainer.step}))
    trainer.checkpointer.close()
    loader.close()
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--interval", type=int, default=3)
    parser.add_argument("--load-step", type=int, default=-1)
    parser.add_argument("--stop-after", type=int, default=None, help="leave after this step, as if the job died")
    parser.add_argument("--end-with-data", action="store_true", help="the Trainer with batchplane's EndWithData mixed in")
    parser.add_argument(
        "--reference",
        nargs=3,
        metavar=("ENDPOINTS", "DUMP", "OUT"),
        help="first run, in the same ranks, the whole job of another data plane (its endpoints file) uninterrupted, "
        "with the same model, optimizer and schedule from the same seed: the reference run",
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.reference:
        endpoints, dump, out = args.reference
        job = os.environ["BATCHPLANE_ENDPOINTS"]
        os.environ["BATCHPLANE_ENDPOINTS"] = endpoints
        train(args, rank, world, dump=pathlib.Path(dump), out=pathlib.Path(out), stop_after=None)
        os.environ["BATCHPLANE_ENDPOINTS"] = job
    train(args, rank, world, dump=args.dump, out=args.out, stop_after=args.stop_after)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
