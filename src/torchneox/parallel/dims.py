"""ParallelDims: the sizes of the run's parallel axes and the one DeviceMesh built from them.

Everything that needs a process group asks a ParallelDims (passed explicitly), never a global.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchneox.base.errors import ConfigError
from torchneox.config.layout import Layout
from torchneox.parallel import flight_recorder


@dataclass
class ParallelDims:
    dp: int
    tp: int
    pp: int
    world_size: int
    device_type: str
    ep: int = 1
    """Expert-parallel ranks: a sub-axis of the data-parallel one."""
    dp_shard: int | None = None
    """Hybrid sharding: the data-parallel ranks a ZeRO shard group spans (None: all)."""
    cp: int = 1
    """Context-parallel ranks: they split each sample's sequence."""
    mesh: DeviceMesh | None = field(default=None, repr=False)
    flat: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    """The flattened axes (dp under expert parallelism or hybrid sharding, dp_cp), as
    ``_flatten`` returned them: slicing them from the root mesh is deprecated."""

    @classmethod
    def from_layout(cls, layout: Layout, device_type: str) -> ParallelDims:
        return cls(
            dp=layout.dp,
            tp=layout.tp,
            pp=layout.pp,
            world_size=layout.gpus,
            device_type=device_type,
            ep=layout.ep,
            dp_shard=layout.dp_shard if layout.hybrid else None,
            cp=layout.cp,
        )

    def __post_init__(self) -> None:
        if self.dp * self.tp * self.pp * self.cp != self.world_size:
            context = f" x context {self.cp}" if self.cp > 1 else ""
            raise ConfigError(
                f"data {self.dp} x tensor {self.tp} x pipeline {self.pp}{context} parallel ranks "
                f"make {self.dp * self.tp * self.pp * self.cp} processes, but {self.world_size} "
                "are running"
            )

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def batch_ranks(self) -> int:
        """The ranks that split a step's tokens: data-parallel x context-parallel."""
        return self.dp * self.cp

    @property
    def batch_mesh(self) -> DeviceMesh:
        """Their mesh: the ranks gradients are reduced over and a batch's sums are added over."""
        assert self.mesh is not None
        return self.axis("dp_cp" if self.cp > 1 else "dp")

    @property
    def dp_rank(self) -> int:
        return self.axis("dp").get_local_rank() if self.mesh is not None else 0

    def axis(self, name: str) -> DeviceMesh:
        """The 1-D mesh of the axis ``name``, flattened or not."""
        assert self.mesh is not None
        return self.flat[name] if name in self.flat else self.mesh[name]

    def build_mesh(self) -> DeviceMesh | None:
        if not self.distributed:
            return None
        if self.ep > 1:
            return self._hybrid_groups(self._expert_mesh())
        if self.dp_shard is not None and self.cp == 1:
            # hybrid sharding: data parallel = (replicas) x (ranks one shard group spans)
            self.mesh = init_device_mesh(
                self.device_type,
                (self.pp, self.dp // self.dp_shard, self.dp_shard, self.tp),
                mesh_dim_names=("pp", "dp_hybrid_replicate", "dp_hybrid_shard", "tp"),
            )
            self.flat = {"dp": self.mesh[self.HYBRID]._flatten("dp")}
            return self.mesh
        if self.cp > 1:  # the sequence's ranks sit between data and tensor parallel
            self.mesh = init_device_mesh(
                self.device_type,
                (self.pp, self.dp, self.cp, self.tp),
                mesh_dim_names=("pp", "dp", "cp", "tp"),
            )
            self.flat = {"dp_cp": self.mesh["dp", "cp"]._flatten("dp_cp")}
            return self._hybrid_groups(self.mesh)
        self.mesh = init_device_mesh(
            self.device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp")
        )
        return self.mesh

    HYBRID = ("dp_hybrid_replicate", "dp_hybrid_shard")

    def _hybrid_groups(self, mesh: DeviceMesh) -> DeviceMesh:
        """Hybrid sharding beside expert or context parallelism: the ranks that split the
        batch (data-parallel, their context ranks innermost) cut into consecutive groups of
        ``dp_shard`` data-parallel ranks with their context ranks, ZeRO sharding within a
        group and replicating across the groups (``shard_mesh``)."""
        if self.dp_shard is not None:
            shape = (self.dp // self.dp_shard, self.dp_shard * self.cp)
            self.flat["hybrid"] = self.batch_mesh._unflatten(0, shape, self.HYBRID)
        return mesh

    def _expert_mesh(self) -> DeviceMesh:
        """Data parallel = (replicas of the experts) x (expert-parallel ranks); with context
        parallelism its ranks sit between them and tensor parallel, and each context rank's
        tokens reach the experts of its own expert-parallel group. ``expert_replicas``: the
        ranks holding the same experts (the replicas, and the context ranks beside them)."""
        names = ["pp", "dp_replicate", "ep", "tp"]
        shape = [self.pp, self.dp // self.ep, self.ep, self.tp]
        if self.cp > 1:
            names.insert(3, "cp")
            shape.insert(3, self.cp)
        self.mesh = init_device_mesh(self.device_type, tuple(shape), mesh_dim_names=tuple(names))
        self.flat = {"dp": self.mesh["dp_replicate", "ep"]._flatten("dp")}
        if self.cp > 1:
            self.flat["dp_cp"] = self.mesh["dp_replicate", "ep", "cp"]._flatten("dp_cp")
            self.flat["expert_replicas"] = self.mesh["dp_replicate", "cp"]._flatten(
                "expert_replicas"
            )
        else:
            self.flat["expert_replicas"] = self.mesh["dp_replicate"]
        return self.mesh

    def shard_mesh(self) -> DeviceMesh:
        """The mesh ZeRO shards over: the data-parallel axis (with context parallelism, the
        data- and context-parallel ranks together), or with hybrid sharding the 2-D
        (replicate, shard) mesh that makes FSDP2 shard within groups and replicate across."""
        assert self.mesh is not None
        if "hybrid" in self.flat:
            return self.flat["hybrid"]
        return self.mesh[self.HYBRID] if self.dp_shard is not None else self.batch_mesh


def init_distributed(
    device_type: str, backend: str | None, timeout_minutes: float, host_too: bool = False
) -> int:
    """Join the process group torchrun describes (WORLD_SIZE, RANK, MASTER_ADDR ...); the world
    size. ``host_too`` (ZeRO-Offload): gloo beside the GPU backend, for the collectives on host
    tensors (the gradient norm of offloaded gradients), and a group of one for a lone process
    (FSDP2, which offloads, shards over a mesh)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_initialized():
        return dist.get_world_size()
    if world == 1 and host_too:
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        store = dist.HashStore()
        dist.init_process_group(
            _backend(device_type, backend, True), store=store, rank=0, world_size=1
        )
        return 1
    if world == 1:
        return 1
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    flight_recorder.enable()
    chosen = _backend(device_type, backend, host_too)
    dist.init_process_group(chosen, timeout=timedelta(minutes=timeout_minutes))
    return world


def _backend(device_type: str, backend: str | None, host_too: bool) -> str:
    chosen = "gloo" if device_type == "cpu" else (backend or "nccl")
    return f"cpu:gloo,{device_type}:{chosen}" if host_too and device_type != "cpu" else chosen


def shutdown(clean: bool = True) -> None:
    """Leave the process group (DTensor users otherwise abort at exit on torch 2.13). After a
    failure (``clean`` False) other ranks may be gone, so there is no barrier."""
    if dist.is_initialized():
        import gc

        gc.collect()
        if clean:
            dist.barrier()
        dist.destroy_process_group()
