"""ZeRO stages as torch runs them: 0 = DDP (replicated gradients), 1 and 2 = FSDP2 with the
parameters kept gathered between forward and backward, 3 = FSDP2 resharding after forward."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.nn.parallel import DistributedDataParallel

from torchneox.config.features.offload import Offload
from torchneox.models.transformer import Transformer

REDUCE_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
}


def apply_data_parallel(
    model: Transformer,
    mesh: DeviceMesh,
    zero_stage: int,
    reduce_dtype: str,
    tensor_parallel: bool = False,
    ignored: list[str] | None = None,
    param_dtype: str = "fp32",
    offload: Offload | None = None,
) -> torch.nn.Module:
    """Shard or replicate ``model`` over ``mesh`` (the data-parallel axis); returns the module to
    call. DDP does not take tensor-parallel (DTensor) parameters, so ZeRO 0 with tensor
    parallelism runs as ZeRO 2 (sharded gradients and optimizer state; the same results).
    FSDP2 gathers the weights in ``param_dtype`` (the fp32 shards are the master weights) and
    reduces gradients in ``reduce_dtype``. ``offload`` (ZeRO-Offload, ZeRO 1-3): FSDP2's
    CPUOffloadPolicy keeps the shards, their gradients and the optimizer state in host memory
    (pinned where the mesh is on GPUs and pin_memory asks), the step runs on the CPU."""
    if zero_stage == 0 and not tensor_parallel:
        if next(model.parameters()).is_meta:  # the dry run: DDP needs values (it broadcasts)
            return model
        if ignored:  # expert-parallel weights: their gradients are reduced elsewhere
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
        return DistributedDataParallel(model, process_group=mesh.get_group())
    gather = REDUCE_DTYPES[param_dtype]
    policy = MixedPrecisionPolicy(
        param_dtype=gather if gather != torch.float32 else None,
        reduce_dtype=REDUCE_DTYPES[reduce_dtype],
    )
    reshard = zero_stage == 3
    skip = {model.get_parameter(n) for n in ignored or []}
    where = _offload_policy(offload, mesh)
    for unit in _units(model):
        own = {p for b in unit for p in b.parameters() if p in skip} or None
        if gather != torch.float32 and len(unit) == 1:
            _shard_fp32_mixers(unit[0], mesh, reshard, REDUCE_DTYPES[reduce_dtype], where)
        fully_shard(
            unit if len(unit) > 1 else unit[0],
            mesh=mesh,
            reshard_after_forward=reshard,
            mp_policy=policy,
            offload_policy=where,
            ignored_params=own,
        )
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=reshard,
        mp_policy=policy,
        offload_policy=where,
        ignored_params=skip or None,
    )
    return model


def _offload_policy(offload: Offload | None, mesh: DeviceMesh) -> OffloadPolicy:
    """FSDP2's policy for ``offload``: CPUOffloadPolicy (pinning only on GPUs: a CPU-only torch
    has no page-locked memory), else none."""
    if offload is None or not offload.enabled:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=offload.pin_memory and mesh.device_type == "cuda")


def _units(model: Transformer) -> list[list[torch.nn.Module]]:
    """The FSDP units below the root: each block alone, or under layer weight sharing the
    blocks that hold one owner's tensors together (a tensor cannot be in two units), so ZeRO-3
    gathers one unique block at a time, for each layer that uses it."""
    owners = model.args.layer_owners
    if not owners:
        return [[block] for block in model.layers.values()]
    groups: dict[int, list[torch.nn.Module]] = {}
    for name, block in model.layers.items():
        groups.setdefault(owners[int(name)], []).append(block)
    return list(groups.values())


def _shard_fp32_mixers(
    block: torch.nn.Module,
    mesh: DeviceMesh,
    reshard: bool,
    reduce: torch.dtype,
    where: OffloadPolicy,
) -> None:
    """mamba_selective_fp32_params: a mixer that asks (``gather_fp32``) is sharded on its own
    and gathered in fp32, so A_log and D reach the scan unrounded while the rest of the block
    is gathered in bf16 (its linears compute in bf16 under autocast either way)."""
    for mixer in (m for m in block.modules() if getattr(m, "gather_fp32", False)):
        policy = MixedPrecisionPolicy(reduce_dtype=reduce)
        fully_shard(
            mixer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=where
        )


def offloaded_shards(model: torch.nn.Module) -> tuple[int, int, int]:
    """(parameters FSDP2 offloads whose shard is in host memory, parameters FSDP2 shards, the
    model's other parameters: expert-parallel weights, which ZeRO leaves alone): what the run
    reports under ZeRO-Offload, read from FSDP2's own parameter records."""
    from torch.distributed.fsdp import FSDPModule

    offloaded = total = 0
    for module in model.modules():
        group = (
            module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        )
        for param in group.fsdp_params if group is not None else []:
            total += 1
            host = param.sharded_param.to_local().device.type == "cpu"
            offloaded += int(param.offload_to_cpu and host)
    return offloaded, total, sum(1 for _ in model.parameters()) - total


def offload_line(model: torch.nn.Module) -> str:
    """The run's line on what ZeRO-Offload holds in host memory."""
    held, total, other = offloaded_shards(model)
    kept = (
        f"; {other} expert-parallel weights (not ZeRO's shards) stay on the device" if other else ""
    )
    return (
        f"ZeRO-Offload: {held} of {total} parameter shards, their gradients and the optimizer "
        f"state in host memory (FSDP2's CPUOffloadPolicy); step on the CPU{kept}"
    )


def set_gradient_sync(module: torch.nn.Module, sync: bool) -> None:
    """Skip the gradient reduction on all but the last micro-batch of a step."""
    if isinstance(module, DistributedDataParallel):
        module.require_backward_grad_sync = sync
    elif hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(sync)


def shard_frozen(model: Transformer, mesh: DeviceMesh, ignored: list[str] | None = None) -> None:
    """A model that only runs forward (DPO's and KTO's reference) sharded over ``mesh`` as a
    ZeRO run shards its policy: each block gathered for its forward, then freed again."""
    skip = {model.get_parameter(n) for n in ignored or []}
    for unit in _units(model):
        own = {p for b in unit for p in b.parameters() if p in skip} or None
        target = unit if len(unit) > 1 else unit[0]
        fully_shard(target, mesh=mesh, reshard_after_forward=True, ignored_params=own)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, ignored_params=skip or None)
