"""The training run: its components built from their config groups, and the loop that wires
them. The parallel layouts plug into the same loop; the step, the checkpoints, the evaluation,
the metrics and the profiler each live in their own module."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchneox.base.errors import ConfigError, DataError, TrainingStopped
from torchneox.base.faults import fault_point
from torchneox.checkpoint.fine_tuning import (
    Resumed,
    post_training,
    refuse_fine_tuning_nothing,
    refuse_saving_over_inputs,
)
from torchneox.checkpoint.hf_io import (
    check_save_hf,
    fresh_heads,
    load_hf_weights,
    save_hf,
    save_line,
)
from torchneox.checkpoint.manager import CheckpointManager, TrainingState
from torchneox.checkpoint.tensors import missing_heads
from torchneox.checkpoint.weights import copy_weights
from torchneox.config.derivations.model import mamba_kernels
from torchneox.config.derive import derive
from torchneox.config.features.fp8_plan import FP8Plan, fp8_plan
from torchneox.config.features.lora import refuse_other_adapter_scale
from torchneox.config.features.streaming import streams
from torchneox.config.layout import require
from torchneox.config.load import LoadedConfig, with_absolute_paths
from torchneox.config.paths import remove_if_empty
from torchneox.config.report import render_yaml
from torchneox.data.datasets import build_splits
from torchneox.data.epochs import apply_train_epochs, cycle_epochs
from torchneox.data.loader import BatchLoader
from torchneox.data.tokenizers import build_tokenizer
from torchneox.models import cpu_kernels
from torchneox.models.hf.folder import is_hf_folder, with_hf_folder
from torchneox.models.params import SOFT_PROMPT, is_adapter
from torchneox.optim.lr import Schedule
from torchneox.parallel.collectives import any_rank, mean_over_dp, sum_over_dp
from torchneox.parallel.data_parallel import offload_line
from torchneox.parallel.dims import ParallelDims
from torchneox.parallel.fp8 import check_fp8_hardware
from torchneox.parallel.parallelize import EVERY_PARAMETER
from torchneox.reporting import hardware
from torchneox.reporting.metrics import MetricsLogger, Throughput, Timers
from torchneox.reporting.profiling import Profiler
from torchneox.reporting.progress import StepProgress
from torchneox.train.assembly import add_step, build_run
from torchneox.train.diloco import outer_state
from torchneox.train.evaluation import Evaluator
from torchneox.train.fits import allocation_failure, refuse_what_cannot_fit
from torchneox.train.guards import Guards
from torchneox.train.processes import (
    context_changes,
    fix_malloc_threshold,
    is_lost_rank,
    join_processes,
    lost_rank_message,
    pick_device,
    stream_loaders,
)
from torchneox.train.replicas import data_share, groups, start_replicas
from torchneox.train.soft_prompt import start_soft_prompt

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the terminal went away
STEP_KEYS = ("lm_loss", "lr", "grad_norm", "skipped", "z_loss", "moe_aux_loss")


class Trainer:
    def __init__(
        self,
        loaded: LoadedConfig,
        device: str | None = None,
        load_step: int | None = None,
        force: bool = False,
    ):
        save = loaded.config.checkpoint.save
        made = save is not None and not Path(save).exists()
        try:
            self._start(loaded, device, load_step, force)
        except (ConfigError, DataError):
            if made:  # a run refused as it starts leaves no save folder of its own behind
                remove_if_empty(Path(save))
            raise

    def _start(
        self, loaded: LoadedConfig, device: str | None, load_step: int | None, force: bool
    ) -> None:
        self.loaded = loaded = with_hf_folder(loaded)  # load: a Hugging Face folder's keys
        self.force = force  # save_hf may replace a folder that holds something
        self.cfg = cfg = loaded.config
        if load_step is None:  # (a step asked for is resolved, or refused, by find)
            refuse_fine_tuning_nothing(loaded)  # before any process group, file or model
        refuse_saving_over_inputs(loaded)
        self.device = pick_device(device)
        fix_malloc_threshold(self.device)  # freed temporaries go back to the system
        world = join_processes(cfg, self.device)
        self.loaded = loaded = apply_train_epochs(loaded, world)  # train_epochs -> train_iters
        self.cfg = cfg = loaded.config
        self.derived = d = derive(loaded, world_size=world)
        self.layout = require(loaded, d)
        check_save_hf(loaded, force, self.layout.pp)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # (before the mesh is made)
        held = "cpu" if self.layout.offload else self.device  # (offload: in host memory)
        refuse_what_cannot_fit(loaded, d["num_parameters"], world, local_ranks, held)
        self.dims = ParallelDims.from_layout(self.layout, self.device.type)
        self.dims.build_mesh()
        self.precision = d["precision"]
        self.train_iters = cfg.training.train_iters
        self.iteration = 0
        self.stop_requested = False
        self._open_outputs()
        for note in d.notes:  # what config explain lists as notes: warnings of the config
            self.logger.line(f"note: {note}")
        # the checkpoint to load, known before building: its weights are not drawn first
        step_dir = self.checkpoints.start_dir(cfg.checkpoint.load, load_step, post_training(cfg))
        # a run that continues another computes with its kernels: no verdict timed a second time
        step = step_dir.name.removeprefix("global_step") if step_dir is not None else "0"
        cpu_kernels.second_timing = not (step.isdigit() and int(step) > 0)
        self._build_checked(step_dir)
        self._report_memory("after building")
        self._report_offload()
        self._build_loaders()
        self._build_step()
        self.throughput = Throughput(
            cfg.logging.peak_theoretical_tflops,
            self.device,
            self.precision,
            d["flops_per_token"],
            self.dims.world_size,
            self.logger.line,
        )
        self.evaluator = self._build_evaluator()
        self.outer = outer_state(self)  # DiLoCo's outer state: a checkpoint may hold it
        resumed = self._resume_or_start(step_dir)
        self.replicas = start_replicas(self)  # ft_lighthouse: this run is one replica group
        if self.parts.reference is not None and not (resumed and resumed.reference):
            copy_weights(self.model, self.parts.reference)  # the policy as training starts

    # ------------------------------------------------------------------------- setup

    def _open_outputs(self) -> None:
        """The checkpoints and the metrics logger."""
        cfg = self.cfg
        # what every checkpoint records of the config: its paths absolute, so it loads anywhere;
        # made first: an unwritable save directory is refused before anything is written
        self.checkpoints = CheckpointManager(
            cfg.checkpoint,
            self.train_iters,
            render_yaml(with_absolute_paths(self.loaded), self.derived),
            self.dims.is_rank0,
            lambda text: self.logger.line(text),
        )
        log_dir = cfg.logging.log_dir or cfg.checkpoint.save
        self.logger = MetricsLogger(
            cfg.logging, Path(log_dir) if log_dir else None, cfg.to_flat(), rank0=self.dims.is_rank0
        )

    def _fp8(self) -> FP8Plan | None:
        plan = fp8_plan(self.cfg.precision, self.cfg.model)
        if plan is not None:
            check_fp8_hardware(plan, self.device)
        return plan

    def _build_checked(self, step_dir: Path | None) -> None:
        """_build_model, with a build that runs out of memory said in one line."""
        try:
            self._build_model(step_dir)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            params = self.derived["num_parameters"]
            failure = allocation_failure(self.loaded, params, self.device, e)
            if failure is None:
                raise
            raise failure from None

    def _build_model(self, step_dir: Path | None) -> None:
        """The policy (and the reference) built shard by shard; its weights drawn from the seed,
        or, when a checkpoint will be loaded, none drawn but the heads it lacks."""
        cfg = self.cfg
        masked = cfg.training.eod_mask_loss or cfg.model.inter_document_attention_masking
        eod = build_tokenizer(cfg.tokenizer).eod_id if masked else None
        init = EVERY_PARAMETER if step_dir is None else fresh_heads(step_dir)
        self.assembly = run = build_run(
            self.loaded, self.derived, self.layout, self.dims, self.device, init, eod, self._fp8()
        )
        self.args, self.scaler, self.objective = run.args, run.scaler, run.objective
        self.parts = run.parts
        self.model, self.pipeline = self.parts.model, self.parts.pipeline
        self._announce_weights(step_dir)

    def _announce_weights(self, step_dir: Path | None) -> None:
        """Where the weights come from, and how many parameter tensors a rank drew (the most
        any rank drew: with a pipeline, each draws its own stages')."""
        drawn = self.parts.drawn
        if self.dims.world_size > 1:
            count = torch.tensor([drawn], dtype=torch.long, device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            drawn = int(count.item())
        if step_dir is None:
            shards = ", each rank keeping only its shards" if self.dims.world_size > 1 else ""
            seed = self.cfg.training.seed
            self.logger.line(f"weights: {drawn} parameter tensors drawn from seed {seed}{shards}")
        else:
            drawn_text = (
                f"{drawn} fresh tensor(s) initialised (heads or LoRA adapters it lacks)"
                if drawn
                else "none initialised"
            )
            into = "into each rank's shards" if self.dims.world_size > 1 else "into the model"
            self.logger.line(f"weights: read from {step_dir} {into}; {drawn_text}")

    def _report_memory(self, when: str) -> None:
        """Every rank's peak memory so far, in one line on rank 0."""
        mine = hardware.peak_memory(self.device)
        peaks = [mine]
        if self.dims.world_size > 1:
            peaks = [None] * self.dims.world_size
            dist.all_gather_object(peaks, mine)
        self.logger.line(hardware.memory_line(when, self.device, peaks))

    def _report_offload(self) -> None:
        """Under ZeRO-Offload, how many parameter shards FSDP2 holds in host memory."""
        if self.layout.offload:
            self.logger.line(offload_line(self.parts.model))

    def _report_kernels(self) -> None:
        """The CPU kernel verdicts any rank corrected (models/cpu_kernels.py), in one line on
        rank 0 (the rank that timed a verdict again may be another)."""
        corrected = cpu_kernels.take_corrections()
        if self.dims.world_size > 1 and self.device.type == "cpu":
            gathered: list[Any] = [None] * self.dims.world_size
            dist.all_gather_object(gathered, corrected)
            corrected = list(dict.fromkeys(c for rank in gathered for c in rank))
        if corrected:
            self.logger.line(cpu_kernels.correction_line(corrected))

    def _build_loaders(self) -> None:
        d, cfg, lay = self.derived, self.cfg, self.layout
        if cfg.training.train_impl == "reinforce":  # rollouts, not datasets
            from torchneox.train.rl.sources import build_rollouts

            self.data_notes = []
            loaders = build_rollouts(self, self.parts.module, self.logger.line)
            self.train_loader = loaders["train"]
            self.valid_loader, self.test_loader = loaders.get("valid"), loaders.get("test")
            return
        if streams(cfg.data):  # raw text tokenized as it trains
            self.data_notes, loaders = [], stream_loaders(cfg, d, lay, self.dims)
            self.train_loader, self.valid_loader = loaders["train"], loaders["valid"]
            self.test_loader = loaders["test"]
            return
        splits = build_splits(cfg, d["train_batch_size"] * groups(cfg), d["padded_vocab_size"])
        splits.train = cycle_epochs(cfg, splits.train, d)
        self.data_notes = splits.notes
        share = data_share(cfg, self.dims)  # replica groups: this group's share of each batch

        def loader(split: Any, prefetch: bool) -> BatchLoader | None:
            if not split:
                return None
            return BatchLoader(split, lay.micro_batch, lay.gas, prefetch=prefetch, **share)

        self.train_loader = loader(splits.train, cfg.data.num_workers > 0)
        self.valid_loader = loader(splits.valid, False)
        self.test_loader = loader(splits.test, False)

    def _build_step(self) -> None:
        cfg = self.cfg
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        self.timers = Timers(cfg.logging.wall_clock_breakdown, sync)
        add_step(
            self.assembly,
            self.timers,
            self.logger.line,
            self.checkpoints.last_good,
            settle_every=cfg.logging.log_interval,
        )
        run = self.assembly
        self.optimizer, self.schedule, self.step = run.optimizer, run.schedule, run.step
        self.guards = Guards(cfg.guards, self.dims, self.device, self.logger.line)

    def _build_evaluator(self) -> Evaluator:
        tg = self.cfg.textgen
        harness = None
        if tg.eval_tasks:  # the lm-eval adapter, checked at start-up, not at the first eval
            from torchneox.train.lm_eval import make_adapter

            tokenizer = build_tokenizer(self.cfg.tokenizer)
            scored = self.model
            if self.pipeline is not None:  # the stages as one module, its logits on every rank
                from torchneox.parallel.pipeline import PipelineLogits

                scored = PipelineLogits(self.pipeline, self.dims.mesh["pp"], self.device)
            harness = make_adapter(
                scored, self.args, tokenizer, self.layout.micro_batch, self.device
            )
        return Evaluator(
            self.model,
            self.cfg.training.eval_iters,
            self.step.eval_losses,
            lambda v: mean_over_dp(v, self.dims),
            self.logger,
            tg,
            harness,
        )

    @property
    def state(self) -> TrainingState:
        loaders = {"train": self.train_loader}
        if self.valid_loader is not None:
            loaders["valid"] = self.valid_loader
        pipelined = self.parts.pipeline is not None
        held = (self.model, self.optimizer, self.scaler, loaders, self.parts.reference)
        return TrainingState(*held, pipelined, self.outer)

    @property
    def peak_tflops(self) -> float | None:
        return self.throughput.peak_tflops

    def _resume_or_start(self, step_dir: Path | None) -> Resumed | None:
        """The checkpoint's state read (None: none loaded); a soft prompt the run starts set
        from init_string."""
        resumed = self._resume(step_dir) if step_dir is not None else None
        fresh = step_dir is None or is_hf_folder(step_dir) or SOFT_PROMPT in missing_heads(step_dir)
        if start_soft_prompt(self.model, self.cfg, fresh):
            self.logger.line("soft prompt: set from the embeddings of init_string's tokens")
        return resumed

    def _resume(self, step_dir: Path) -> Resumed:
        if is_hf_folder(step_dir):
            resumed = load_hf_weights(step_dir, self.model, self.args, self.logger.line)
            if any(is_adapter(n) for n, _ in self.model.named_parameters()):
                # LoRA: the checkpoints hold the adapters and name the folder as their base
                self.checkpoints.adapt(step_dir)
            return resumed
        resumed = self.checkpoints.resume(step_dir, self.state)
        if not resumed.training_state:
            return resumed
        self.iteration = resumed.iteration
        from torchneox.checkpoint.files import checkpoint_config

        saved = checkpoint_config(resumed.step_dir)
        if self.checkpoints.resuming_own:
            refuse_other_adapter_scale(saved.config, self.cfg, resumed.step_dir)
        if self.cfg.lr.use_checkpoint_lr_scheduler:
            sd = derive(saved, world_size=self.dims.world_size)
            self.schedule = Schedule.from_config(saved.config.lr, sd)
            self.logger.line(
                "learning-rate schedule taken from the checkpoint (use_checkpoint_lr_scheduler)"
            )
        self.logger.line(f"resumed from {resumed.step_dir} at iteration {self.iteration}")
        changed = context_changes(saved.config, self.cfg)
        if changed:
            self.logger.line(
                f"context extended: {'; '.join(changed)}; the samples are "
                f"{self.cfg.model.seq_length} tokens from here on (the sample index is built for "
                "that length; the run goes on at the same sample count)"
            )
        return resumed

    # -------------------------------------------------------------------------- step

    def train_step(self) -> Mapping[str, float] | None:
        if self.replicas is not None:  # the step committed by the live replica groups
            return self.replicas.train_step()
        iteration = self.iteration + 1
        fault_point("step.start", iteration)
        lr = self.schedule.lr_for_update(iteration)
        with self.timers("data"):
            micro_batches = self.train_loader.next()
        self.guards.step_start()  # straggler_factor: each rank's own time measured
        out = self.step(iteration, lr, micro_batches)
        self.iteration = iteration
        # a spike rewound (spike_action rewind): the run is back at its last checkpoint
        return None if self.guards.rewound(self, out) else out

    def evaluate(self, loader: BatchLoader, iters: int) -> float:
        return self.evaluator.loss(loader, iters)

    def save(self) -> Path | None:
        self.step.settle()  # a step the skip policy has not seen is not saved
        return self.checkpoints.save(self.iteration, self.state)

    # -------------------------------------------------------------------------- run

    def _stop_agreed(self) -> bool:
        """Whether any rank was asked to stop (ranks may see a signal at different steps), or
        rank 0's standard output went away."""
        self.stop_requested |= self.logger.stdout_lost
        return any_rank(self.stop_requested, self.dims, self.device)

    def _request_stop(self, signum: int, frame: Any) -> None:
        self.stop_requested = True
        self.logger.line(
            f"received {signal.Signals(signum).name}: saving after this step, then exiting"
        )

    def run(self) -> dict[str, Any]:
        old = {s: signal.signal(s, self._request_stop) for s in STOP_SIGNALS}
        try:
            summary = self._loop()
            if self.logger.stdout_lost:
                raise TrainingStopped(self._stdout_lost_message())
            return summary
        except RuntimeError as e:
            if not is_lost_rank(e):
                raise
            raise TrainingStopped(lost_rank_message(self, e)) from None
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            self.train_loader.close()
            self.logger.close()
            if self.replicas is not None:
                self.replicas.close()

    def _stdout_lost_message(self) -> str:
        saved = f"step {self.iteration} is saved" if self.checkpoints.save_dir else "no save is set"
        then = (
            "training finished"
            if self.iteration >= self.train_iters
            else "rerun the same command to resume"
        )
        return (
            f"standard output went away (a closed pipe or terminal) during training; {saved}; "
            f"{then}"
        )

    def _announce(self) -> None:
        d = self.derived
        self.logger.line(
            f"training {self.args.num_layers} layers x {self.args.hidden_size} "
            f"({d['num_parameters']:,} parameters) on {self.device} in {self.precision}, "
            f"{self.train_iters} steps of {d['train_batch_size']} x {self.cfg.model.seq_length} "
            f"tokens; MFU against {self.throughput.peak_source}"
        )
        for note in self.data_notes:
            self.logger.line(note)
        for why in dict.fromkeys(d.unused.values()):  # a line per reason, naming its keys
            names = sorted(k for k, v in d.unused.items() if v == why)
            has = "has" if len(names) == 1 else "have"
            self.logger.line(f"warning: {', '.join(names)} {has} no effect here: {why}")
        slow = hardware.cpu_precision_warning(self.precision) if self.device.type == "cpu" else None
        if slow:
            self.logger.line(slow)
        if "mamba" in self.args.layer_types:  # which kernels run the mamba layers
            self.logger.line(f"mamba: {mamba_kernels(self.cfg.model, self.device.type)}")
        if self.dims.dp_shard is not None:
            groups = self.dims.dp // self.dims.dp_shard
            self.logger.line(
                f"hybrid sharding: ZeRO {self.layout.zero} state sharded within {groups} groups "
                f"of {self.dims.dp_shard} data-parallel ranks, replicated across the groups"
            )
        if self.dims.cp > 1:
            seq, cp = self.cfg.model.seq_length, self.dims.cp
            self.logger.line(
                f"context parallel: each sample's {seq} tokens split over {cp} ranks "
                f"({seq // cp} each, two chunks); attention gathers every rank's keys and values"
            )
        if self.checkpoints.save_dir is None:
            self.logger.line(
                "warning: no save is set, so nothing of this run is kept (no checkpoint); set "
                "save to keep it"
            )

    def _loop(self) -> dict[str, Any]:
        t = self.cfg.training
        self._announce()
        if self.iteration == 0 and 0 in self.checkpoints.save_at:
            self.save()
        progress = StepProgress(self, self.derived["train_batch_size"] * self.cfg.model.seq_length)
        profiler = Profiler(
            self.cfg.logging,
            self.cfg.checkpoint.save,
            self.device,
            self.iteration,
            self.logger.line,
        )
        first = self.iteration + 1
        while self.iteration < self.train_iters:
            out = self.train_step()
            if out is None:  # rewound to the last checkpoint, past the spike's batches
                continue
            if self.iteration == first:
                self._report_memory("after the first step")
                self._report_kernels()
            self.checkpoints.poll()  # a background save all ranks have written: finish it
            profiler.step()
            progress.report(out)
            if self.iteration % t.eval_interval == 0:
                self.evaluator.split_row("valid", self.valid_loader, self.iteration)
                self.evaluator.tasks_row(self.iteration)
            exiting = self._stop_agreed() or bool(
                t.exit_interval and self.iteration % t.exit_interval == 0
            )
            if self.iteration in self.checkpoints.save_at or exiting:
                self.save()
            if exiting:
                self.logger.line(
                    f"stopped at step {self.iteration}; rerun the same command to resume"
                )
                break
        self.step.settle()
        self._report_kernels()  # verdicts first met by the evaluation's shapes
        self.checkpoints.finish()
        if self.cfg.checkpoint.save_hf and self.iteration >= self.train_iters:
            out = save_hf(self.loaded, self.model, self.args, self.force, self.dims.is_rank0)
            self.logger.line(save_line(out, self.args))
        profiler.stop()
        return self._summary(progress.last_row)

    def _summary(self, last_row: dict[str, Any] | None) -> dict[str, Any]:
        summary: dict[str, Any] = {"iteration": self.iteration, "train": last_row}
        if self.iteration >= self.train_iters:
            # as GPT-NeoX: one more validation and a test run after the last step
            end, ev = "at the end of training", self.evaluator
            summary["valid"] = ev.split_row("valid", self.valid_loader, self.iteration, end)
            if self.iteration % self.cfg.training.eval_interval:  # not run at this step yet
                summary["tasks"] = ev.tasks_row(self.iteration)
            summary["test"] = ev.split_row("test", self.test_loader, self.iteration, end)
        return summary

    def step_row(self, out: Mapping[str, float], seconds: float, tokens: int) -> dict[str, Any]:
        """The metrics row of a logged step (``seconds`` per step over the logging window)."""
        row = {"iteration": self.iteration, "lm_loss": out["lm_loss"], "lr": out["lr"]}
        row["grad_norm"] = out["grad_norm"]
        speed = self.throughput.measure(tokens, seconds)
        row |= speed | {"step_time_s": seconds, "skipped_steps": self.scaler.skipped}
        if self.precision == "fp16":
            row["loss_scale"] = self.scaler.scale
        if "z_loss" in out:
            row["z_loss"] = out["z_loss"]
        row |= {k: out[k] for k in self.objective_metrics(out)}
        row |= self._loader_row() | self.guards.row(self.iteration)
        if "moe_aux_loss" in out:
            row["moe_aux_loss"] = out["moe_aux_loss"]
            counts = sum_over_dp(torch.stack(self.step.gradients.moe_counts), self.dims)
            row["moe_tokens_per_expert"] = counts.tolist()  # [MoE layer][expert], this step
            row["moe_max_load"] = (
                (counts.amax(1) / counts.float().mean(1).clamp(min=1)).max().item()
            )
            biases = [m.router_bias for m in self.step.gradients.moe_layers]
            if any(b is not None for b in biases):  # moe_router_bias_update_rate
                row["moe_router_bias"] = [[] if b is None else b.tolist() for b in biases]
        return row

    @property
    def loader_metrics(self) -> dict[str, float]:
        """What the train loader says of its last batch (a reinforce run's rollouts: completion
        length, sampling time and tokens/s)."""
        return dict(getattr(self.train_loader, "stats", {}))

    def _loader_row(self) -> dict[str, float]:
        """The loader's statistics over the whole run: each a mean over the data-parallel ranks
        (a reinforce run's rollouts: completion length, sampling seconds), its tokens/s their
        sum (collective when distributed)."""
        stats = self.loader_metrics
        if not stats or self.dims.dp == 1:
            return stats
        names = sorted(stats)
        local = torch.tensor([stats[n] for n in names], dtype=torch.float64, device=self.device)
        out = dict(zip(names, mean_over_dp(local, self.dims).tolist(), strict=True))
        for name in names:
            if name.endswith(("tokens_per_sec", "_records")):  # sums over the ranks
                out[name] *= self.dims.dp
        return out

    def console_metrics(self, out: Mapping[str, float]) -> tuple[str, ...]:
        """What the console line shows beside the loss: the objective's metrics (those it names
        for the console, when it does) and the loader's."""
        names = self.objective_metrics(out)
        console = getattr(self.objective, "console", None)
        if console is not None:
            names = tuple(n for n in names if n in console)
        stats = self.loader_metrics
        return names + tuple(k for k in getattr(self.train_loader, "console", ()) if k in stats)

    @staticmethod
    def objective_metrics(out: Mapping[str, float]) -> tuple[str, ...]:
        """The names of the objective's own metrics in a step's values."""
        return tuple(k for k in out if k not in STEP_KEYS)
