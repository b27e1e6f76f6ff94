"""A model's weights read from a checkpoint (``files.py``'s) into the tensors
the model already has, whole or this rank's shards, so that no rank reads more than it holds:
the one way every verb turns a checkpoint into a model (``load_model``), and what a resumed
run loads (``load_model_weights``)."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from torchneox.base.errors import ConfigError
from torchneox.checkpoint.files import (
    MANIFEST_FILE,
    META_FILE,
    checkpoint_config,
    load_state,
    read_meta,
    resolve,
)
from torchneox.checkpoint.tensors import FRESH_HEADS, missing_heads, refuse_non_finite
from torchneox.config.features.lora import LoraSpec, is_base_linear, lora_spec
from torchneox.config.load import LoadedConfig
from torchneox.models.args import model_args
from torchneox.models.hf.architectures import weight_files
from torchneox.models.hf.folder import is_hf_folder
from torchneox.models.lora import adapted_weight, merge_any
from torchneox.models.params import is_adapter, plain_name, trains_with_lora
from torchneox.models.transformer import Transformer
from torchneox.parallel.shards import local_part

LORA_BASE = "lora_base"
"""meta.json's entry of a checkpoint that holds only LoRA adapters: the checkpoint (a step
directory), or the Hugging Face model folder, that holds the frozen base weights they adapt."""
LORA_BASE_FINGERPRINT = "lora_base_fingerprint"
"""meta.json's fingerprint of that base (``base_fingerprint``), checked when it is loaded:
adapters merged into another model of the same shape compute nonsense."""
SAMPLES, SAMPLE_BYTES = 16, 4096


def base_fingerprint(base: Path) -> str:
    """What identifies a base's weights without reading them all: a checkpoint's manifest (its
    files' sizes and content checksums, written when it was saved); else (a Hugging Face
    folder, a checkpoint older than manifests) each weight file's name, size and 16 samples of
    4 KiB spread over it (another model of the same shape differs in them all)."""
    digest = hashlib.sha256()
    if (base / MANIFEST_FILE).is_file():
        digest.update((base / MANIFEST_FILE).read_bytes())
        return f"manifest-sha256:{digest.hexdigest()}"
    files = weight_files(base) if is_hf_folder(base) else sorted(base.glob("*.distcp"))
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}:".encode())
        with open(path, "rb") as f:
            for i in range(SAMPLES):
                f.seek(max(0, size - SAMPLE_BYTES) * i // (SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return f"sampled-sha256:{digest.hexdigest()}"


def lora_base(step_dir: Path) -> Path | None:
    """The checkpoint holding the frozen base of an adapters-only checkpoint (None: it holds
    every weight); one line when it is gone, or holds other weights than the adapters were
    trained on (its fingerprint changed; checkpoints saved before fingerprints load as
    before)."""
    meta = read_meta(step_dir) if (step_dir / META_FILE).is_file() else {}
    base = meta.get(LORA_BASE)
    if base is None:
        return None
    if not (Path(base) / META_FILE).is_file() and not is_hf_folder(base):
        raise ConfigError(
            f"holds only LoRA adapters, and the checkpoint of their base weights, {base}, is "
            "gone; put it back there",
            source=str(step_dir),
        )
    recorded = meta.get(LORA_BASE_FINGERPRINT)
    if recorded is not None and base_fingerprint(Path(base)) != recorded:
        raise ConfigError(
            f"holds only LoRA adapters, trained on the base weights in {base}, which were "
            "replaced since (its fingerprint differs): the adapters would be merged into "
            "another model; put the original base back there",
            source=str(step_dir),
        )
    return Path(base)


def base_of_adapters(step_dir: Path, save_dir: Path | None) -> str | None:
    """What a LoRA run that loaded ``step_dir`` names as its base in the adapters-only
    checkpoints it saves: the base ``step_dir`` names, else ``step_dir`` itself unless it lies
    in the run's own save folder (which rotation may empty: then it saves every weight)."""
    base = lora_base(step_dir)
    if base is not None:
        return str(base)
    whole = step_dir.resolve()
    if save_dir is not None and whole.is_relative_to(Path(save_dir).resolve()):
        return None
    return str(whole)


def load_model_weights(
    step_dir: Path,
    model: torch.nn.Module,
    prefix: str = "model",
    line: Callable[[str], None] | None = None,
) -> list[str]:
    """Load the checkpoint's ``prefix`` weights into ``model`` (an adapters-only checkpoint's:
    the base's from the checkpoint it names, then its adapters); returns the fresh heads and
    LoRA adapters the checkpoint did not have (they keep their initialisation). The
    checkpoint's adapters are never dropped: a model without adapters takes them merged into
    its weights (said by ``line``), one whose lora names fewer layers is refused."""
    base = lora_base(step_dir) if prefix == "model" else None
    if base is None:
        fresh = _load_weights(step_dir, model, prefix, None)
    else:
        if is_hf_folder(base):  # a run that started from a Hugging Face folder
            from torchneox.checkpoint.hf_io import load_hf_weights

            load_hf_weights(base, model, model.args, lambda _: None)
        else:
            _load_weights(base, model, prefix, lambda k: not trains_with_lora(k))
        fresh = _load_weights(step_dir, model, prefix, trains_with_lora)
    held = held_adapters(step_dir, prefix)
    if held:
        _take_adapters(step_dir, model, prefix, held, line or (lambda _: None))
    _say_left_out(step_dir, model, prefix, line or (lambda _: None))
    return fresh


LEFT_OUT = {
    "soft_prompt.weight": "a soft prompt ({0} tokens), which this run (no soft_prompt_tuning) "
    "leaves out: the model reads the text without it",
    "value_head.weight": "a reward model's value head, which this run leaves out (it is not a "
    "reward model run)",
}
"""Trained tensors a checkpoint may hold that a model of another kind has no place for."""


def _say_left_out(
    step_dir: Path, model: torch.nn.Module, prefix: str, line: Callable[[str], None]
) -> None:
    """Say which trained tensors of ``step_dir`` the model leaves out (a soft prompt, a value
    head): they cannot be merged into the weights the way adapters are."""
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    mine = set(model.state_dict())
    for name, what in LEFT_OUT.items():
        entry = metadata.get(f"{prefix}.{name}")
        if entry is not None and name not in mine:
            line(f"warning: {step_dir} holds {what.format(entry.size[0])}")


def held_adapters(step_dir: Path, prefix: str = "model") -> dict[str, tuple[int, ...]]:
    """The LoRA adapter tensors ``step_dir`` holds (names under ``prefix``), with their shapes."""
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    start = f"{prefix}."
    return {
        k.removeprefix(start): tuple(v.size)
        for k, v in metadata.items()
        if k.startswith(start) and is_adapter(k)
    }


def adapted_kinds(names: Iterable[str]) -> list[str]:
    """The adapted layers' kinds (attention.wq, ...) of adapter tensor names."""
    layers = (plain_name(n).rsplit(".lora_", 1)[0] for n in names if is_adapter(n))
    return sorted({".".join(layer.split(".")[2:]) for layer in layers})


def _take_adapters(
    step_dir: Path,
    model: torch.nn.Module,
    prefix: str,
    held: dict[str, tuple[int, ...]],
    line: Callable[[str], None],
) -> None:
    """The checkpoint's adapters in a model with adapters: each layer they adapt must have
    one (the loaded ones); in a model without: merged into the weights they adapt."""
    kinds = adapted_kinds(held)
    ours = adapted_kinds(n for n, _ in model.named_parameters())
    if ours:
        dropped = [k for k in kinds if k not in ours]
        if dropped:
            raise ConfigError(
                f"holds LoRA adapters on {', '.join(dropped)}, which lora.target_modules does "
                f"not name ({', '.join(ours)}): they would be dropped; add them to "
                "target_modules (or leave the lora key out: the adapters are then merged "
                "into the weights)",
                source=str(step_dir),
                key="lora.target_modules",
            )
        return
    spec = lora_spec(checkpoint_config(step_dir).config)
    merge_adapters(step_dir, model, prefix, held, spec)
    line(
        f"{step_dir} holds LoRA adapters (on {', '.join(kinds)}) and this run has no lora key: "
        f"they are merged into the weights they adapt (W + {spec.scale:g} x B @ A), so it "
        "starts from the model they trained (keep the lora key to train the adapters on)"
    )


@torch.no_grad()
def merge_adapters(
    step_dir: Path,
    model: torch.nn.Module,
    prefix: str,
    held: dict[str, tuple[int, ...]],
    spec: LoraSpec,
) -> None:
    """The checkpoint's adapters (read whole: they are small) merged into ``model``'s weights
    as ``convert to-hf`` merges them (W + scale x B @ A), into this rank's part of each; a
    base the run stored in bf16 (lora.base_dtype) rounded to it first, as it trained."""
    adapters = {k: torch.empty(shape) for k, shape in held.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({prefix: adapters}, checkpoint_id=str(step_dir), no_dist=True)
    refuse_non_finite(adapters, step_dir)
    params = {plain_name(n): p for n, p in model.named_parameters()}
    for name, param in params.items():
        if spec.base_dtype == "bf16" and is_base_linear(name):
            local, _ = local_part(param)
            local.copy_(local.bfloat16())
    for layer in sorted({k.rsplit(".lora_", 1)[0] for k in held}):
        param = params.get(adapted_weight(layer))
        if param is None:  # another pipeline stage's
            continue
        local, where = local_part(param)
        a, b = adapters[f"{layer}.lora_A.weight"], adapters[f"{layer}.lora_B.weight"]
        if where is not None and local.dim() == 3:  # experts [E, in, out]
            a, b = a[where[0], where[1]], b[where[0], :, where[2]]
        elif where is not None:
            a, b = a[:, where[1]], b[where[0]]
        device = local.device
        local.copy_(merge_any(local, a.to(device), b.to(device), spec.scale))


class OtherModel(ConfigError):
    """A checkpoint whose tensors are not the model's the config describes (one missing, or of
    another shape)."""


def _load_weights(
    step_dir: Path, model: torch.nn.Module, prefix: str, which: Callable[[str], bool] | None
) -> list[str]:
    """The ``which`` weights (None: all) of ``model`` read from ``step_dir``."""
    sd = {k: v for k, v in model.state_dict().items() if which is None or which(k)}
    expected = {k: tuple(v.shape) for k, v in sd.items()}
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
    fresh = []
    for key, shape in expected.items():
        entry = metadata.state_dict_metadata.get(f"{prefix}.{key}")
        if entry is None and (key in FRESH_HEADS or is_adapter(key)):
            fresh.append(key)
            continue
        if entry is None:
            raise OtherModel(f"the checkpoint has no tensor {key}", source=str(step_dir))
        if tuple(entry.size) != shape:
            raise OtherModel(
                f"tensor {key} has shape {tuple(entry.size)} in the checkpoint but {shape} in the "
                "model the config describes",
                source=str(step_dir),
            )
    wanted = {k: v for k, v in sd.items() if k not in fresh}
    load_state(step_dir, {prefix: wanted})
    model.load_state_dict(wanted, strict=not fresh and which is None)
    refuse_non_finite(wanted, step_dir)
    return fresh


@torch.no_grad()
def copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """``source``'s parameters into ``target``, a model of the same shape (either may be
    wrapped for activation checkpointing or compiled). Where the two split a parameter
    differently (a policy that runs ZeRO 0 as ZeRO 2 beside pipeline ranks, a reference
    replicated over them) it is gathered whole and the target takes its part."""
    theirs = {plain_name(n): p for n, p in target.named_parameters()}
    for name, param in source.named_parameters():
        mine = theirs[plain_name(name)]
        if _split_alike(param, mine):
            mine.copy_(param)
            continue
        whole = param.full_tensor() if hasattr(param, "full_tensor") else param
        local, where = local_part(mine)
        local.copy_(whole if where is None else whole[where])


def _split_alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are both whole, or DTensors on one mesh with one placement."""
    if not hasattr(a, "placements") or not hasattr(b, "placements"):
        return not hasattr(a, "placements") and not hasattr(b, "placements")
    return a.device_mesh == b.device_mesh and a.placements == b.placements


def load_model(
    ckpt: str | Path,
    overrides: list[str] | None = None,
    device: str = "cpu",
    step: int | None = None,
    stored_dtype: bool = False,
) -> tuple[LoadedConfig, Transformer]:
    """The model a checkpoint holds (its step, or the latest), on ``device``, with its config
    (``overrides`` applied): the one way every verb turns a checkpoint into a model. Its
    parameters are fp32, or with ``stored_dtype`` the dtype the checkpoint keeps them in (a
    bf16 model converted from the hub is then one bf16 copy in memory, not an fp32 one)."""
    step_dir = resolve(ckpt, step)
    loaded = checkpoint_config(step_dir, overrides)
    dtype = _stored_dtype(step_dir) if stored_dtype else torch.float32
    # nothing drawn but the heads the checkpoint lacks: every other weight is read from it
    with torch.device("meta"):
        model = Transformer(model_args(loaded)).to(dtype)
    model.to_empty(device=device)
    model.init_weights(device, only=missing_heads(step_dir))
    load_model_weights(step_dir, model)
    round_stored_base(model)
    return loaded, model


@torch.no_grad()
def round_stored_base(model: Transformer) -> None:
    """A LoRA run's base stored in bf16 (lora.base_dtype) trained with its weights rounded to
    bf16: a model read back in fp32 holds those rounded values, so it computes what was
    trained (its base read from an fp32 checkpoint or folder would otherwise be the
    unrounded one)."""
    if model.args.lora_base_dtype != "bf16":
        return
    for name, param in model.named_parameters():
        if is_base_linear(name) and param.dtype != torch.bfloat16:
            param.copy_(param.bfloat16())


def _stored_dtype(step_dir: Path) -> torch.dtype:
    """The one floating dtype of the checkpoint's model tensors (fp32 when they mix)."""
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
    dtypes = {
        getattr(entry, "properties", None) and entry.properties.dtype
        for name, entry in metadata.state_dict_metadata.items()
        if name.startswith("model.")
    }
    return dtypes.pop() if len(dtypes) == 1 and None not in dtypes else torch.float32
