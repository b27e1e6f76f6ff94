"""Replica groups that survive each other (torchft; the ft_* keys).

Each replica group is an ordinary run (any number of processes, its own layout and save
folder). Between its backward and its update, every step's gradients are averaged over the
live groups through torchft's managed process group (the replicate axis that spans groups,
one rank of each group with the same rank of the others), and the update is applied only when
the quorum commits the step. A step the quorum does not commit (a group died during it) is
trained again on the same batch by the groups still live.

Data: the batch keys describe one group; each step's global batch is ft_replica_groups times
that, and group g reads share g of it (as data-parallel ranks g x dp .. g x dp + dp - 1 of one
large run would). The share of a group that is not live is skipped, not re-queued: the step's
batch is smaller, its mean gradient over the samples trained, and each logged step names how
many groups were live (``replica_groups``).

A group that starts (or restarts) behind the others joins the next quorum and heals from a
live peer over torchft's checkpoint transport: model, optimizer state, loss scaler, data
position, generators and the step (the schedule follows from it), not from disk."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from torchneox.base.faults import fault_point
from torchneox.config.checks.ft import replicated
from torchneox.config.features.replicas import sync_words
from torchneox.optim.builder import load_optimizer_state, optimizer_state
from torchneox.parallel.collectives import plain


def groups(cfg: Any) -> int:
    """How many replica groups share each step's global batch (1: no replica groups)."""
    return cfg.ft.ft_replica_groups if replicated(cfg) else 1


def data_share(cfg: Any, dims: Any) -> dict[str, int]:
    """This rank's share of each global batch: its data-parallel rank among every group's."""
    group = cfg.ft.ft_replica_group if replicated(cfg) else 0
    return {"dp_rank": group * dims.dp + dims.dp_rank, "dp_size": groups(cfg) * dims.dp}


def start_replicas(trainer: Any) -> Replicas | None:
    """The run's replica group, joined to the lighthouse (None: no replica groups)."""
    return Replicas(trainer) if replicated(trainer.cfg) else None


def _shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (a plain tensor as it is)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _local(value: Any) -> Any:
    return _shard(value) if isinstance(value, torch.Tensor) else value


class Replicas:
    """One replica group's torchft Manager, and the training step that goes through it."""

    def __init__(self, trainer: Any):
        from torchft import Manager
        from torchft.checkpointing.http_transport import HTTPTransport

        self.t = t = trainer
        f = t.cfg.ft
        self.group, self.groups, self.live = f.ft_replica_group, f.ft_replica_groups, None
        timeout = timedelta(seconds=f.ft_timeout_seconds)
        host, port = self._store()
        self.manager = Manager(
            pg=self._process_group(timeout),
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=f.ft_min_replicas,
            use_async_quorum=False,  # a healing group loads its peer's state before it trains
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=t.dims.rank,
            world_size=t.dims.world_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=f.ft_lighthouse,
            replica_id=f"torchneox_group_{self.group}",
            init_sync=False,  # every group draws the same weights from the seed
            checkpoint_transport=HTTPTransport(timeout=timeout, num_chunks=0),
        )
        self.diloco = self._diloco() if f.ft_diloco_sync_every else None
        # the quorum's step: the step of the last update all groups agreed on (under DiLoCo,
        # the last sync's), so that a group restarted from an older checkpoint is the one
        # behind, and heals
        since = t.outer.steps_since_sync() if self.diloco is not None else 0
        self._agreed(t.iteration - since)
        t.logger.line(
            f"replica group {self.group} of {self.groups} through the lighthouse at "
            f"{f.ft_lighthouse}: {sync_words(t.cfg)}; a missing group's share of each batch is "
            "skipped"
        )

    def _store(self) -> tuple[str, int]:
        """The group's TCP store that torchft's Manager meets in: the launcher's, or (one
        process, no launcher) one of its own."""
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        from torch.distributed import TCPStore

        self.own_store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        return "localhost", self.own_store.port

    def _process_group(self, timeout: timedelta) -> Any:
        from torchft import ProcessGroupBabyNCCL, ProcessGroupGloo

        if self.t.device.type == "cuda":
            return ProcessGroupBabyNCCL(timeout=timeout)
        return ProcessGroupGloo(timeout=timeout)

    # ----------------------------------------------------------------------- the step

    def train_step(self) -> Any:
        """One committed step: quorum (healing first if this group is behind), the gradients,
        their mean over the live groups, then the update once the quorum commits; a step not
        committed is trained again on the same batch."""
        t = self.t
        if self.diloco is not None:
            return self._local_step()
        while True:
            fault_point("step.start", t.iteration + 1)  # before the quorum: a held group waits
            t.step.settle()  # the skip policy's count is part of what a peer heals from
            self.manager.start_quorum()
            self._say_live(self.manager.num_participants(), t.iteration + 1)
            iteration = t.iteration + 1
            lr = t.schedule.lr_for_update(iteration)
            position = t.train_loader.state_dict()
            with t.timers("data"):
                micro_batches = t.train_loader.next()
            loss, metrics = t.step.checked_gradients(iteration, micro_batches)
            loss = self._average(loss)
            self._sum_loads()
            if self.manager.should_commit():
                t.iteration = iteration
                values = t.step.apply(iteration, lr, loss, metrics)
                values._known["replica_groups"] = float(self.live)
                return values
            t.optimizer.zero_grad(set_to_none=True)
            t.train_loader.load_state_dict(position)
            t.logger.line(f"step {iteration}: not committed by the replica groups; trained again")

    def _local_step(self) -> Any:
        """DiLoCo: a step of this group alone (its own optimizer, the inner one); every
        ft_diloco_sync_every steps, torchft's DiLoCo then averages the pseudo-gradients over the
        live groups and applies the outer step (a sync the quorum does not commit puts the
        weights back to the last sync's)."""
        t = self.t
        iteration = t.iteration + 1
        fault_point("step.start", iteration)
        lr = t.schedule.lr_for_update(iteration)
        with t.timers("data"):
            micro_batches = t.train_loader.next()
        values = t.step(iteration, lr, micro_batches)
        t.iteration = iteration
        t.step.settle()  # the skip policy's count is part of what a peer heals from
        agreed = self.manager.current_step()
        # after the inner step, where torchft's DiLoCo hooks its optimizer: the step is whole here
        self.diloco._step_post_hook(t.optimizer, (), {})
        if self.diloco._local_step == 0:  # synced: the quorum it synced in
            self._say_live(self.manager.num_participants(), t.iteration)
            values._known["replica_groups"] = float(self.live)
            if self.manager.current_step() > agreed:  # committed (t.iteration: a healed one's)
                self._agreed(t.iteration)
        return values

    def _agreed(self, step: int) -> None:
        self.manager.load_state_dict(
            {"step": step, "batches_committed": self.manager.batches_committed()}
        )

    def _diloco(self) -> Any:
        """torchft's DiLoCo over the whole model: the run's optimizer inside, the outer SGD
        (``t.outer``, where a resumed checkpoint put its state) outside."""
        t, f = self.t, self.t.cfg.ft
        t.logger.line(
            f"DiLoCo: every {f.ft_diloco_sync_every} steps the groups average their "
            f"pseudo-gradients and SGD (lr {f.ft_diloco_outer_lr}, momentum "
            f"{f.ft_diloco_outer_momentum}{', Nesterov' if f.ft_diloco_outer_nesterov else ''}) "
            "applies them"
        )
        return t.outer.attach(self.manager, t.optimizer, t.device)

    def _say_live(self, live: int, iteration: int) -> None:
        if live != self.live:
            t = self.t
            skipped = "" if live >= self.groups else "; the missing groups' shares are skipped"
            t.logger.line(
                f"replica groups: {live} of {self.groups} live from step {iteration}{skipped}"
            )
        self.live = live

    def _average(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradients (this rank's shards of them) and the loss, each the mean over the live
        groups' same ranks; one collective per gradient dtype."""
        grads = [_shard(p.grad) for p in self.t.model.parameters() if p.grad is not None]
        works = []
        for dtype in dict.fromkeys(g.dtype for g in grads):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            works.append((same, flat, self.manager.allreduce(flat)))
        total = plain(loss).detach().float().reshape(1).clone()
        loss_work = self.manager.allreduce(total)
        for same, flat, work in works:
            work.wait()
            offset = 0
            for g in same:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        loss_work.wait()
        return total.reshape(()).to(loss.dtype)

    def _sum_loads(self) -> None:
        """Each MoE layer's tokens per expert, summed over the live groups' same ranks: the
        router bias (moe_router_bias_update_rate) moves by the load of every group's tokens, the
        same in every group, and the logged load is the whole step's."""
        from torch.distributed import ReduceOp

        counts = self.t.step.gradients.moe_counts
        works = [self.manager.allreduce(c, reduce_op=ReduceOp.SUM) for c in counts]
        for work in works:
            work.wait()

    # ------------------------------------------------------------------ healing

    def _state(self) -> dict[str, Any]:
        """What a peer heals from (called in torchft's quorum thread while this group's main
        thread waits for the quorum): this rank's shards as plain tensors."""
        t = self.t
        model = {k: _local(v) for k, v in get_model_state_dict(t.model).items()}
        optim = None
        if t.optimizer.state:  # an optimizer that never stepped has none
            optim = pytree.tree_map(_local, optimizer_state(t.model, t.optimizer, False))
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return {
            "iteration": t.iteration,
            "model": model,
            "optimizer": optim,
            "scaler": t.scaler.state_dict(),
            "loaders": {
                name: getattr(loader, "heal_state", loader.state_dict)()
                for name, loader in t.state.loaders.items()
            },
            "rng": torch.get_rng_state(),
            "cuda_rng": cuda,
        }

    @torch.no_grad()
    def _load(self, sd: dict[str, Any]) -> None:
        """A live peer's state, into this group's own tensors (the same layout's shards)."""
        t = self.t
        for name, mine in get_model_state_dict(t.model).items():
            _shard(mine).copy_(sd["model"][name])
        if sd["optimizer"] is not None:
            if hasattr(t.optimizer, "init_state"):  # SM3, madgrad_wd, LAMB
                t.optimizer.init_state()
            mine = optimizer_state(t.model, t.optimizer, False)  # a fresh one: its state made
            ours, spec = pytree.tree_flatten(mine)
            theirs, _ = pytree.tree_flatten(sd["optimizer"])
            leaves = [_into(o, v) for o, v in zip(ours, theirs, strict=True)]
            load_optimizer_state(t.model, t.optimizer, pytree.tree_unflatten(leaves, spec))
        t.scaler.load_state_dict(sd["scaler"])
        for name, loader in t.state.loaders.items():  # (REINFORCE's rows: this group's own)
            getattr(loader, "heal", loader.load_state_dict)(sd["loaders"][name])
        torch.set_rng_state(sd["rng"])
        if sd["cuda_rng"] is not None:
            torch.cuda.set_rng_state_all(sd["cuda_rng"])
        t.iteration = sd["iteration"]
        t.logger.line(
            f"replica group {self.group}: healed from a live group at step {t.iteration} (model, "
            "optimizer, loss scale, data position, generators)"
        )

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _into(mine: Any, theirs: Any) -> Any:
    """A leaf of this rank's state with a peer's value: a tensor copied into its own storage."""
    if isinstance(mine, torch.Tensor):
        _shard(mine).copy_(theirs)
        return mine
    return theirs
