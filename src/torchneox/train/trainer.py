"""The training loop on one process: steps, accumulation, clipping, precision, evaluation,
checkpoints, metrics. The parallel layouts plug into this same loop."""

from __future__ import annotations

import math
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from torchneox.base.errors import ConfigError, TrainingStopped
from torchneox.base.faults import fault_point
from torchneox.config.derive import Derived, derive
from torchneox.config.layout import Layout, check_layout
from torchneox.config.load import LoadedConfig, with_absolute_paths
from torchneox.config.report import render_yaml
from torchneox.data.datasets import build_splits
from torchneox.data.loader import BatchLoader
from torchneox.data.tokenizers import build_tokenizer
from torchneox.models.args import ModelArgs
from torchneox.models.moe import MoE, balancing_loss
from torchneox.models.transformer import Transformer, build_model
from torchneox.parallel.activation_ckpt import apply_activation_checkpointing, compile_blocks
from torchneox.parallel.collectives import sum_router_stats
from torchneox.parallel.data_parallel import apply_data_parallel, set_gradient_sync
from torchneox.parallel.dims import ParallelDims, init_distributed
from torchneox.parallel.expert_parallel import apply_expert_parallel, sync_expert_gradients
from torchneox.parallel.pipeline import Pipeline, build_pipeline, evaluate_pipeline
from torchneox.parallel.tensor_parallel import apply_tensor_parallel, loss_context
from torchneox.train import checkpoint, hardware
from torchneox.train.loss import lm_loss, lm_loss_and_z
from torchneox.train.lr import Schedule
from torchneox.train.metrics import MetricsLogger, Timers
from torchneox.train.optim import build_optimizer, clip_grad_norm, shard_gradients_like_parameters
from torchneox.train.precision import LossScaler, autocast


def save_iterations(cfg: Any, train_iters: int) -> set[int]:
    """GPT-NeoX's checkpoint steps: multiples (linear) or powers (log) of checkpoint_factor,
    extra_save_iters, and the last step."""
    ck = cfg.checkpoint
    steps = {train_iters}
    factor = ck.checkpoint_factor
    if factor:
        if ck.checkpoint_scale == "linear":
            steps |= set(range(factor, train_iters + 1, factor))
        else:
            power = 1
            while power <= train_iters:
                steps.add(power)
                power *= factor
    steps |= set(ck.extra_save_iters or [])
    return steps


def require(loaded: LoadedConfig, derived: Derived) -> Layout:
    """What training needs beyond what `derive` checks, and the checked layout (`train --nproc`
    runs it before it starts any process)."""
    cfg = loaded.config
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "train_iters"):
        if cfg.get(name) is None:
            raise ConfigError("training needs it; add it to a config file or --set it", key=name)
    if derived["train_batch_size"] is None:
        raise ConfigError(
            "training needs train_micro_batch_size_per_gpu or train_batch_size",
            key="train_micro_batch_size_per_gpu",
        )
    if derived["lr"] is None:
        raise ConfigError("training needs a learning rate (optimizer.params.lr)", key="optimizer")
    layout = Layout.from_derived(cfg, derived)
    check_layout(loaded, layout)
    return layout


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _device(requested: str | None) -> torch.device:
    if requested:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _is_lost_rank(error: RuntimeError) -> bool:
    """Whether a collective failed because a peer died or stopped answering (gloo/NCCL)."""
    text = str(error).lower()
    return isinstance(error, dist.DistError) or any(
        marker in text
        for marker in ("timed out", "timeout", "connection closed by peer", "connection reset")
    )


class Trainer:
    def __init__(
        self, loaded: LoadedConfig, device: str | None = None, load_step: int | None = None
    ):
        self.loaded = loaded
        self.cfg = cfg = loaded.config
        self.device = _device(device)
        world = init_distributed(
            self.device.type,
            cfg.parallel.distributed_backend,
            cfg.parallel.distributed_timeout_minutes,
        )
        self.derived = d = derive(loaded, world_size=world)
        self.layout = require(loaded, d)
        self.dims = ParallelDims.from_layout(self.layout, self.device.type)
        self.dims.build_mesh()
        self.precision = d["precision"]
        self.seq_length = cfg.model.seq_length
        self.micro_batch = d["train_micro_batch_size_per_gpu"]
        self.grad_accum = d["gradient_accumulation_steps"]
        self.train_iters = cfg.training.train_iters
        self._build_model()
        self.schedule = Schedule.from_config(cfg, d)
        self.scaler = LossScaler.from_config(cfg, self.precision)
        self.clip = d["gradient_clipping"]
        self.z_weight = cfg.training.lm_z_loss
        self.eod_id = build_tokenizer(cfg).eod_id if cfg.training.eod_mask_loss else None
        self._build_loaders()
        self.iteration = 0
        self.save_dir = Path(cfg.checkpoint.save) if cfg.checkpoint.save else None
        if self.save_dir is not None:
            checkpoint.ensure_writable(self.save_dir)
        self.save_at = save_iterations(cfg, self.train_iters)
        # what every checkpoint records of the config: its paths absolute, so it loads anywhere
        self.config_yaml = render_yaml(with_absolute_paths(loaded), d)
        log_dir = cfg.logging.log_dir or cfg.checkpoint.save
        self.logger = MetricsLogger(
            cfg, Path(log_dir) if log_dir else None, cfg.to_flat(), rank0=self.dims.is_rank0
        )
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        self.timers = Timers(cfg.logging.wall_clock_breakdown, sync)
        self.peak_tflops, self.peak_source = self._peak()
        self.harness = self._harness() if cfg.textgen.eval_tasks else None
        self.stop_requested = False
        if cfg.checkpoint.load:
            self._resume(Path(cfg.checkpoint.load), load_step)

    # ------------------------------------------------------------------------- setup

    def _build_model(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.training.seed)
        self.args = ModelArgs.from_config(cfg, self.derived["padded_vocab_size"])
        self.tensor_parallel = self.dims.tp > 1
        self.pipeline: Pipeline | None = None
        if self.dims.pp > 1:
            self._build_pipeline()
        else:
            self.model = build_model(self.args, device=self.device, seed=cfg.training.seed)
            self.module: torch.nn.Module = self._prepare(self.model)
        self.optimizer = build_optimizer(self.model, cfg, self.device.type)
        self.moe_layers = [m for m in self.model.modules() if isinstance(m, MoE)]

    def _prepare(self, model: Transformer) -> torch.nn.Module:
        """Parallelism from outside, in torchtitan's order: tensor parallel, activation
        checkpointing, compile, data parallel. Returns the module to call."""
        cfg = self.cfg
        if self.tensor_parallel:
            apply_tensor_parallel(model, self.dims.mesh["tp"], cfg.parallel.sequence_parallel)
        expert_params: list[str] = []
        if self.dims.ep > 1:
            expert_params = apply_expert_parallel(model, self.dims.mesh)
        if cfg.training.checkpoint_activations:
            apply_activation_checkpointing(
                model,
                cfg.training.checkpoint_num_layers,
                cfg.training.checkpoint_activations_mode,
            )
        if cfg.training.compile:
            compile_blocks(model)
        if self.dims.dp > 1:
            sharded_only = self.tensor_parallel or self.dims.pp > 1  # DDP takes neither
            return apply_data_parallel(
                model,
                self.dims.mesh["dp"],
                self.derived["zero_stage"],
                self.derived["gradient_reduce_dtype"],
                tensor_parallel=sharded_only,
                ignored=expert_params,
            )
        return model

    def _build_pipeline(self) -> None:
        cfg = self.cfg

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return lm_loss(logits, labels, None) * self.scaler.scale

        self.pipeline = build_pipeline(
            self.args,
            self.dims.mesh["pp"],
            self.device,
            self.derived["pipeline_schedule"],
            cfg.parallel.pipeline_virtual_stages,
            self.grad_accum,
            cfg.parallel.pipe_partition_method,
            loss_fn,
            cfg.training.seed,
            prepare=self._prepare,
        )
        self.model = self.pipeline.container
        self.module = self.model

    def _build_loaders(self) -> None:
        d, cfg = self.derived, self.cfg
        splits = build_splits(cfg, d["train_batch_size"], d["padded_vocab_size"])
        self.data_notes = splits.notes
        share = {"dp_rank": self.dims.dp_rank, "dp_size": self.dims.dp}
        self.train_loader = BatchLoader(
            splits.train,
            self.micro_batch,
            self.grad_accum,
            prefetch=cfg.data.num_workers > 0,
            **share,
        )
        self.valid_loader = (
            BatchLoader(splits.valid, self.micro_batch, self.grad_accum, prefetch=False, **share)
            if splits.valid
            else None
        )
        self.test_loader = (
            BatchLoader(splits.test, self.micro_batch, self.grad_accum, prefetch=False, **share)
            if splits.test
            else None
        )

    def _mean_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        if self.dims.distributed:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.dims.mesh["dp"].get_group())
            value /= self.dims.dp
        return value

    def _peak(self) -> tuple[float | None, str]:
        given = self.cfg.logging.peak_theoretical_tflops
        if given:
            return given, f"peak_theoretical_tflops {given:g}"
        acc = hardware.detect(self.device)
        if acc is not None:
            peak = hardware.peak_tflops(acc, self.precision)
            return peak, f"{acc.name} {self.precision} peak {peak:g} TFLOP/s"
        if self.device.type == "cpu":
            peak = hardware.cpu_peak_tflops(self.precision)
            return peak, f"this CPU's measured {self.precision} matmul peak {peak:.3g} TFLOP/s"
        return None, "unknown device: set peak_theoretical_tflops for MFU"

    def _resume(self, load_dir: Path, step: int | None) -> None:
        if step is None and not (load_dir / "latest").is_file():
            # a save killed between its rename and moving 'latest' leaves a complete directory
            newest = checkpoint.newest_complete(load_dir) if load_dir.is_dir() else None
            if newest is None:
                self.logger.line(f"no checkpoint in {load_dir}: starting from scratch")
                return
            step = int(newest.name.removeprefix("global_step"))
        step_dir = checkpoint.resolve(load_dir, step)
        ck = self.cfg.checkpoint
        meta = checkpoint.read_meta(step_dir)
        if ck.finetune or "loaders" not in meta:
            checkpoint.load_model_weights(step_dir, self.model)
            why = (
                "finetune is set"
                if ck.finetune
                else f"it holds weights only ({meta.get('converted_from') or 'no training state'})"
            )
            self.logger.line(
                f"starting at step 0 from the weights of {step_dir}, with a fresh optimizer: {why}"
            )
            return
        checkpoint.load_model_weights(step_dir, self.model)
        state: dict[str, Any] = {}
        if not ck.no_load_optim and meta.get("has_optimizer", False):
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        if not ck.no_load_rng and meta.get("has_rng", False):
            state["rng"] = {"torch": torch.get_rng_state()}
        if state:
            checkpoint.load_state(step_dir, state)
        if "optimizer" in state:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        if "rng" in state:
            torch.set_rng_state(state["rng"]["torch"])
        self.iteration = int(meta["iteration"])
        if self.cfg.lr.use_checkpoint_lr_scheduler:
            saved = checkpoint.checkpoint_config(step_dir)
            sd = derive(saved, world_size=self.dims.world_size)
            self.schedule = Schedule.from_config(saved.config, sd)
            self.logger.line(
                "learning-rate schedule taken from the checkpoint (use_checkpoint_lr_scheduler)"
            )
        self.train_loader.load_state_dict(meta["loaders"]["train"])
        if self.valid_loader is not None and "valid" in meta["loaders"]:
            self.valid_loader.load_state_dict(meta["loaders"]["valid"])
        if "loss_scaler" in meta:
            self.scaler.load_state_dict(meta["loss_scaler"])
        self.logger.line(f"resumed from {step_dir} at iteration {self.iteration}")

    # -------------------------------------------------------------------------- step

    def _forward_backward(self, tokens: torch.Tensor, last: bool) -> torch.Tensor:
        tokens = tokens.to(self.device, non_blocking=True)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        mask = (inputs != self.eod_id) if self.eod_id is not None else None
        set_gradient_sync(self.module, last)
        with loss_context(self.tensor_parallel):
            with self.timers("forward"), autocast(self.precision, self.device.type):
                if self.moe_layers:
                    logits, stats = self.module(inputs, router_stats=True)
                else:
                    logits = self.module(inputs)
                if self.z_weight:
                    loss, z = lm_loss_and_z(logits, labels, mask)
                    objective = loss + self.z_weight * z
                    self._z_loss += z.detach()
                else:
                    loss = objective = lm_loss(logits, labels, mask)
                del logits
                if self.moe_layers:
                    # the load-balancing loss sees the whole batch: the router statistics
                    # summed over the ranks that split it (one process's loss, in any layout)
                    whole = stats
                    if self.dims.dp > 1:
                        whole = [sum_router_stats(s, self.dims.mesh["dp"]) for s in stats]
                    aux = torch.stack([balancing_loss(s) for s in whole]).mean()
                    weighted = self.cfg.moe.moe_aux_loss_coeff * aux
                    if isinstance(loss, DTensor):  # a vocabulary-parallel loss: same placement
                        weighted = DTensor.from_local(weighted, loss.device_mesh, loss.placements)
                    objective = loss + weighted
                    self._moe_aux += aux.detach().float()
                    for i, s in enumerate(stats):
                        self._moe_counts[i] += s.tokens_per_expert
            with self.timers("backward"):
                (objective * (self.scaler.scale / self.grad_accum)).backward()
        return _plain(loss.detach())

    def train_step(self) -> dict[str, float]:
        iteration = self.iteration + 1
        fault_point("step.start", iteration)
        lr = self.schedule.lr_for_update(iteration)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self.timers("data"):
            micro_batches = self.train_loader.next()
        if self.pipeline is not None:
            total = self._pipeline_step(micro_batches, train=True) * self.grad_accum
        else:
            total = torch.zeros((), device=self.device)
        if self.z_weight:
            self._z_loss = torch.zeros((), device=self.device)
        if self.moe_layers:
            self._moe_aux = torch.zeros((), device=self.device)
            self._moe_counts = [
                torch.zeros(m.num_experts, dtype=torch.long, device=self.device)
                for m in self.moe_layers
            ]
        for m, tokens in enumerate(micro_batches if self.pipeline is None else []):
            total += self._forward_backward(tokens, last=m == len(micro_batches) - 1)
        if self.dims.ep > 1:
            sync_expert_gradients(self.model, self.dims.mesh, self.dims.dp)
        fault_point("step.backward", iteration)
        loss = self._mean_over_ranks(total / self.grad_accum).item()
        bad = None if math.isfinite(loss) else f"the loss is {loss}"
        with self.timers("optimizer"):
            grad_norm, skipped = self._apply_gradients(iteration, bad)
        self.iteration = iteration
        out = {"lm_loss": loss, "lr": lr, "grad_norm": grad_norm, "skipped": float(skipped)}
        if self.moe_layers:
            out["moe_aux_loss"] = self._mean_over_ranks(self._moe_aux / self.grad_accum).item()
        if self.z_weight:
            out["z_loss"] = self._mean_over_ranks(self._z_loss / self.grad_accum).item()
        return out

    def _pipeline_step(self, micro_batches: list[torch.Tensor], train: bool) -> torch.Tensor:
        """One global batch through the pipeline; the mean loss, known on every rank."""
        p = self.pipeline
        pp_group = self.dims.mesh["pp"].get_group()
        tokens = torch.cat(micro_batches).to(self.device, non_blocking=True)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        with loss_context(self.tensor_parallel), autocast(self.precision, self.device.type):
            if not train:
                local = evaluate_pipeline(
                    p, inputs, labels, self.grad_accum, self.dims.mesh["pp"], lm_loss
                )
                dist.all_reduce(local, group=pp_group)  # only the last stage adds a loss
                return local
            losses: list[torch.Tensor] = []
            args = (inputs,) if p.has_first else ()
            kwargs = {"target": labels, "losses": losses} if p.has_last else {}
            with self.timers("pipeline"):
                p.schedule.step(*args, **kwargs)
        local = torch.zeros((), device=self.device)
        if p.has_last:
            local = (
                torch.stack([_plain(x).detach().float() for x in losses]).mean() / self.scaler.scale
            )
        dist.all_reduce(local, group=pp_group)
        return local

    def _apply_gradients(self, iteration: int, bad: str | None) -> tuple[float, bool]:
        """Unscale, clip and apply the gradients; returns the gradient norm and whether the step
        was skipped. Non-finite values: in fp16 the loss scaler skips the step and lowers the
        scale; otherwise up to skip_nonfinite_steps steps are skipped, then the run stops."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        shard_gradients_like_parameters(params)
        if self.scaler.scale != 1.0:
            torch._foreach_div_([p.grad for p in params], self.scaler.scale)
        max_norm = self.clip if self.clip > 0 else float("inf")
        pp_group = self.dims.mesh["pp"].get_group() if self.pipeline is not None else None
        norm = clip_grad_norm(params, max_norm, pp_group).item()
        if bad is None and not math.isfinite(norm):
            bad = f"the gradient norm is {norm}"
        if bad is not None and self.precision != "fp16":
            limit = self.cfg.training.skip_nonfinite_steps
            if self.scaler.skipped >= limit:
                more = (
                    f" (the {limit} skips allowed by skip_nonfinite_steps are used up)"
                    if limit
                    else " (skip_nonfinite_steps lets a run skip such steps instead)"
                )
                raise TrainingStopped(self._nonfinite_message(iteration, bad + more))
            self.logger.line(
                f"step {iteration}: {bad}; step skipped ({self.scaler.skipped + 1} of {limit} "
                "allowed by skip_nonfinite_steps)"
            )
        overflow = bad is not None
        if not overflow:
            self.optimizer.step()
        self.scaler.update(overflow)
        self.optimizer.zero_grad(set_to_none=True)
        return norm, overflow

    def _lost_rank_message(self, error: RuntimeError) -> str:
        minutes = self.cfg.parallel.distributed_timeout_minutes
        first = str(error).strip().splitlines()[0]
        return (
            f"rank {self.dims.rank}: a collective did not complete at step {self.iteration + 1} "
            f"(distributed_timeout_minutes is {minutes:g}): another rank died or hangs ({first}); "
            f"{self._last_good()}; rerun the same command to resume once every rank is healthy"
        )

    def _last_good(self) -> str:
        if self.save_dir is not None and (self.save_dir / "latest").is_file():
            return f"the last good checkpoint is {self.save_dir / (self.save_dir / 'latest').read_text().strip()}"
        return "no checkpoint was saved yet"

    def _nonfinite_message(self, iteration: int, what: str) -> str:
        return f"step {iteration}: {what}; stopping without applying it ({self._last_good()})"

    # -------------------------------------------------------------------- evaluation

    @torch.no_grad()
    def evaluate(self, loader: BatchLoader, iters: int) -> float:
        self.model.eval()
        losses = []
        for _ in range(iters):
            if not loader.has_full_batch():
                break
            if self.pipeline is not None:
                losses.append(self._pipeline_step(loader.next(), train=False))
                continue
            for tokens in loader.next():
                tokens = tokens.to(self.device)
                inputs, labels = tokens[:, :-1], tokens[:, 1:]
                mask = (inputs != self.eod_id) if self.eod_id is not None else None
                with loss_context(self.tensor_parallel), autocast(self.precision, self.device.type):
                    losses.append(_plain(lm_loss(self.module(inputs), labels, mask)))
        self.model.train()
        if not losses:
            return float("nan")
        return self._mean_over_ranks(torch.stack(losses).mean()).item()

    def _eval_row(
        self, name: str, loader: BatchLoader | None, when: str = ""
    ) -> dict[str, Any] | None:
        if loader is None or self.cfg.training.eval_iters == 0:
            return None
        loss = self.evaluate(loader, self.cfg.training.eval_iters)
        if math.isnan(loss):
            self.logger.line(f"{name}: no whole batch left in the {name} split; not evaluated")
            return None
        ppl = math.exp(min(loss, 50))
        row = {"iteration": self.iteration, f"{name}_lm_loss": loss, f"{name}_ppl": ppl}
        self.logger.record(row)
        when = when or f"at step {self.iteration}"
        self.logger.line(f"{name} {when}: loss {loss:.4f} | perplexity {ppl:.2f}")
        return row

    def _harness(self):
        """The lm-eval adapter for eval_tasks, checked at start-up rather than at the first
        evaluation."""
        from torchneox.train.lm_eval import make_adapter

        tokenizer = build_tokenizer(self.cfg)
        return make_adapter(self.model, self.args, tokenizer, self.micro_batch, self.device)

    def _eval_tasks_row(self) -> dict[str, Any] | None:
        """GPT-NeoX's eval_tasks: the harness on the current weights; every rank runs the same
        requests (sharded weights need every rank's forward), rank 0 reports."""
        if self.harness is None:
            return None
        from torchneox.train.lm_eval import run_tasks

        tg = self.cfg.textgen
        limit = tg.eval_tasks_limit
        limit = int(limit) if limit is not None and limit >= 1 else limit
        results = run_tasks(self.harness, list(tg.eval_tasks), tg.eval_tasks_include_path, limit)
        self.model.train()
        row = {"iteration": self.iteration, "eval_tasks": results}
        self.logger.record(row)
        for task, metrics in results.items():
            shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
            self.logger.line(f"{task} at step {self.iteration}: {shown}")
        return row

    # ------------------------------------------------------------------- checkpoints

    def save(self) -> Path | None:
        if self.save_dir is None:
            return None
        ck = self.cfg.checkpoint
        state: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        # an optimizer that never stepped has no state to save; asking torch for its state
        # dict would create it with a zero-rate step counted (Adam's bias correction would
        # then be one step off for the rest of the run), so saving never changes training
        if not ck.no_save_optim and self.optimizer.state:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        if not ck.no_save_rng:
            state["rng"] = {"torch": torch.get_rng_state()}
        loaders = {"train": self.train_loader.state_dict()}
        if self.valid_loader is not None:
            loaders["valid"] = self.valid_loader.state_dict()
        meta = {
            "loaders": loaders,
            "loss_scaler": self.scaler.state_dict(),
            "has_optimizer": "optimizer" in state,
            "has_rng": "rng" in state,
        }
        try:
            path = checkpoint.save_checkpoint(
                self.save_dir, self.iteration, state, self.config_yaml, meta
            )
        except checkpoint.CheckpointWriteError as e:
            raise TrainingStopped(str(e)) from None
        self._rotate()
        return path

    def _rotate(self) -> None:
        keep = self.cfg.checkpoint.keep_last_n_checkpoints
        if not keep or self.save_dir is None or not self.dims.is_rank0:
            return
        steps = sorted(
            (int(p.name.removeprefix("global_step")), p)
            for p in self.save_dir.glob("global_step*")
            if p.name.removeprefix("global_step").isdigit()
        )
        for _, path in steps[:-keep]:
            shutil.rmtree(path, ignore_errors=True)

    # -------------------------------------------------------------------------- run

    def _stop_agreed(self) -> bool:
        """Whether any rank was asked to stop (ranks may see a signal at different steps), or
        rank 0's standard output went away."""
        self.stop_requested |= self.logger.stdout_lost
        if not self.dims.distributed:
            return self.stop_requested
        flag = torch.tensor(float(self.stop_requested), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _request_stop(self, signum: int, frame: Any) -> None:
        self.stop_requested = True
        self.logger.line(
            f"received {signal.Signals(signum).name}: saving after this step, then exiting"
        )

    def run(self) -> dict[str, Any]:
        stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the terminal went away
        old = {s: signal.signal(s, self._request_stop) for s in stops}
        try:
            summary = self._loop()
            if self.logger.stdout_lost:
                saved = f"step {self.iteration} is saved" if self.save_dir else "no save is set"
                then = (
                    "training finished"
                    if self.iteration >= self.train_iters
                    else "rerun the same command to resume"
                )
                raise TrainingStopped(
                    f"standard output went away (a closed pipe or terminal) during training; "
                    f"{saved}; {then}"
                )
            return summary
        except RuntimeError as e:
            if not _is_lost_rank(e):
                raise
            raise TrainingStopped(self._lost_rank_message(e)) from None
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            self.train_loader.close()
            self.logger.close()

    def _loop(self) -> dict[str, Any]:
        t, lg = self.cfg.training, self.cfg.logging
        self.logger.line(
            f"training {self.args.num_layers} layers x {self.args.hidden_size} "
            f"({self.derived['num_parameters']:,} parameters) on {self.device} in {self.precision}, "
            f"{self.train_iters} steps of {self.derived['train_batch_size']} x {self.seq_length} tokens; "
            f"MFU against {self.peak_source}"
        )
        for note in self.data_notes:
            self.logger.line(note)
        if self.save_dir is None:
            self.logger.line(
                "warning: no save is set, so nothing of this run is kept (no checkpoint); set "
                "save to keep it"
            )
        if self.iteration == 0 and 0 in self.save_at:
            self.save()
        tokens_per_step = self.derived["train_batch_size"] * self.seq_length
        start_iteration, last_row = self.iteration, None
        window_start, window_steps = time.perf_counter(), 0
        run_start = time.perf_counter()
        profiler = self._profiler()
        while self.iteration < self.train_iters:
            out = self.train_step()
            window_steps += 1
            if profiler is not None:
                profiler.step()
            done = self.iteration - start_iteration
            elapsed = time.perf_counter() - run_start
            eta = elapsed / done * (self.train_iters - self.iteration)
            if self.iteration % lg.log_interval == 0 or self.iteration == self.train_iters:
                seconds = (time.perf_counter() - window_start) / window_steps
                last_row = self._step_row(out, seconds, tokens_per_step)
                self.logger.record(last_row)
                self.logger.line(self.logger.step_text(last_row, self.train_iters, eta))
                if lg.wall_clock_breakdown:
                    self.logger.line("  " + self.timers.report(window_steps))
                window_start, window_steps = time.perf_counter(), 0
            else:
                self.logger.live(
                    f"step {self.iteration}/{self.train_iters} | loss {out['lm_loss']:.4f}"
                )
            if self.iteration % t.eval_interval == 0:
                self._eval_row("valid", self.valid_loader)
                self._eval_tasks_row()
            exiting = self._stop_agreed() or bool(
                t.exit_interval and self.iteration % t.exit_interval == 0
            )
            if self.iteration in self.save_at or exiting:
                self.save()
            if exiting:
                self.logger.line(
                    f"stopped at step {self.iteration}; rerun the same command to resume"
                )
                break
        if profiler is not None:
            profiler.stop()
            self._dump_memory_snapshot()
        summary: dict[str, Any] = {"iteration": self.iteration, "train": last_row}
        if self.iteration >= self.train_iters:
            # as GPT-NeoX: one more validation and a test run after the last step
            summary["valid"] = self._eval_row("valid", self.valid_loader, "at the end of training")
            if self.iteration % self.cfg.training.eval_interval:  # not run at this step yet
                summary["tasks"] = self._eval_tasks_row()
            summary["test"] = self._eval_row("test", self.test_loader, "at the end of training")
        return summary

    def _step_row(
        self, out: dict[str, float], seconds: float, tokens_per_step: int
    ) -> dict[str, Any]:
        tokens_per_sec = tokens_per_step / seconds
        tflops = self.derived["flops_per_token"] * tokens_per_sec / self.dims.world_size / 1e12
        row = {
            "iteration": self.iteration,
            "lm_loss": out["lm_loss"],
            "lr": out["lr"],
            "grad_norm": out["grad_norm"],
            "tokens_per_sec": tokens_per_sec,
            "tflops": tflops,
            "mfu": self._mfu(tflops),
            "step_time_s": seconds,
            "skipped_steps": self.scaler.skipped,
        }
        if self.precision == "fp16":
            row["loss_scale"] = self.scaler.scale
        if "z_loss" in out:
            row["z_loss"] = out["z_loss"]
        if "moe_aux_loss" in out:
            row["moe_aux_loss"] = out["moe_aux_loss"]
            counts = torch.stack(self._moe_counts)
            if self.dims.distributed:
                dist.all_reduce(counts, group=self.dims.mesh["dp"].get_group())
            row["moe_tokens_per_expert"] = counts.tolist()  # [MoE layer][expert], this step
        return row

    def _mfu(self, tflops: float) -> float | None:
        """Model FLOPs utilisation against the stated peak; never above 1: a measured CPU peak
        that a step beat was too low, and is raised (and cached) to what the step achieved."""
        if not self.peak_tflops:
            return None
        if (
            tflops > self.peak_tflops
            and self.device.type == "cpu"
            and not self.cfg.logging.peak_theoretical_tflops
        ):
            hardware.raise_cpu_peak(self.precision, tflops)
            self.logger.line(
                f"a step ran at {tflops:.3g} TFLOP/s, above the measured peak "
                f"{self.peak_tflops:.3g}: the peak is raised to it"
            )
            self.peak_tflops = tflops
        return min(tflops / self.peak_tflops, 1.0)

    def _dump_memory_snapshot(self) -> None:
        lg = self.cfg.logging
        if not (lg.memory_profiling and self.device.type == "cuda"):
            return
        folder = Path(lg.memory_profiling_path or lg.log_dir or self.cfg.checkpoint.save or ".")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "memory_snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.logger.line(
            f"CUDA memory snapshot written to {path} (view it at pytorch.org/memory_viz)"
        )

    def _profiler(self) -> torch.profiler.profile | None:
        lg = self.cfg.logging
        if not lg.profile and not lg.memory_profiling:
            return None
        folder = (
            Path(lg.tensorboard_dir or lg.log_dir or self.cfg.checkpoint.save or ".") / "profile"
        )
        if lg.memory_profiling and self.device.type != "cuda":
            self.logger.line(
                "memory_profiling records CUDA memory snapshots; this run is on the CPU, so it is skipped"
            )
        if lg.memory_profiling and self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100000)
        before = max(lg.profile_step_start - self.iteration - 1, 0)
        warmup = 1 if before else 0  # the step before the window warms the profiler up
        active = lg.profile_step_stop - lg.profile_step_start + 1
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=before - warmup, warmup=warmup, active=active, repeat=1
            ),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(folder)),
            profile_memory=lg.memory_profiling,
        )
        profiler.start()
        return profiler
