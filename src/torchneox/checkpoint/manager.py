"""What a run saves and resumes (``CheckpointManager``): GPT-NeoX's save steps, rotation,
no_save/no_load of optimizer and RNG, finetune, background saves, and the last good
checkpoint that failure messages name. The files are ``files.py``'s."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from torchneox.base.errors import CheckpointWriteError, ConfigError, TrainingStopped, first_line
from torchneox.checkpoint.background import BackgroundSaves
from torchneox.checkpoint.files import (
    BASE_SHAPES,
    CONFIG_FILE,
    META_FILE,
    base_shapes_record,
    changed_model_keys,
    ensure_writable,
    load_state,
    newest_complete,
    numbered_optimizer_groups,
    read_latest,
    read_meta,
    resolve,
    save_checkpoint,
    step_dir_name,
    step_dirs,
)
from torchneox.checkpoint.fine_tuning import Resumed, holds_checkpoint, no_weights_to_fine_tune
from torchneox.checkpoint.s3 import S3Uploads, require_boto3
from torchneox.checkpoint.weights import (
    LORA_BASE,
    LORA_BASE_FINGERPRINT,
    OtherModel,
    adapted_kinds,
    base_fingerprint,
    base_of_adapters,
    held_adapters,
    load_model_weights,
)
from torchneox.models.hf.folder import is_hf_folder
from torchneox.models.params import is_adapter, trains_with_lora
from torchneox.optim.builder import load_optimizer_state, optimizer_state

DILOCO = "diloco"
"""The part of a checkpoint (its tensors and meta.json) that holds DiLoCo's outer state
(train/diloco.py)."""


def save_iterations(ck: Any, train_iters: int) -> set[int]:
    """GPT-NeoX's checkpoint steps: multiples (linear) or powers (log) of checkpoint_factor,
    extra_save_iters, and the last step (``ck``: the checkpoint config group)."""
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


@dataclass
class TrainingState:
    """What a checkpoint saves and a resume restores, besides the config."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any  # LossScaler: state_dict / load_state_dict
    loaders: dict[str, Any]  # name -> BatchLoader (train, and valid when there is one)
    reference: torch.nn.Module | None = None  # DPO's and KTO's frozen reference model
    by_name: bool = False
    """Save the optimizer state keyed by parameter names (``optimizer_state``): a pipeline
    stage's, whose parameters are not the other stages'."""
    extra: Any = None
    """A training part of its own that checkpoints hold (DiLoCo's outer state: see
    train/diloco.py): ``KEY``, ``checkpoint_tensors(with_optimizer)``,
    ``checkpoint_meta(tensors)``, ``template(meta, with_optimizer)``, ``resume(tensors, meta)``."""


class CheckpointManager:
    """Saves, rotates and resumes one run's checkpoints (built from the checkpoint config
    group): GPT-NeoX's save steps, keep_last_n_checkpoints, no_save/no_load of optimizer and
    RNG, finetune, and the last good checkpoint that failure messages name."""

    def __init__(
        self, ck: Any, train_iters: int, config_yaml: str, is_rank0: bool, line: Any
    ) -> None:
        self.ck, self.config_yaml, self.is_rank0, self.line = ck, config_yaml, is_rank0, line
        self.save_dir = Path(ck.save) if ck.save else None
        if self.save_dir is not None:
            ensure_writable(self.save_dir)
        self.save_at = save_iterations(ck, train_iters)
        self.resuming_own = False
        """Set by start_dir: the run resumes its own checkpoint, with its whole training state
        (finetune applies to the start from ``load`` only)."""
        self.lora_base: str | None = None
        """A LoRA run's base checkpoint (set when it loads one): saves hold the adapters only."""
        self.lora_base_fingerprint: str | None = None
        """Its fingerprint, recorded beside it (``base_fingerprint``)."""
        self.base_shapes = base_shapes_record(config_yaml)
        """muP's base_shapes_file and its sha256, kept in each checkpoint's meta.json: a
        resumed run whose file changed would train with other multipliers."""
        self.background = None
        if self.save_dir is not None and ck.async_checkpointing:
            self.background = BackgroundSaves(
                self.save_dir, config_yaml, line, ck.async_checkpoint_writer
            )
        self.uploads = None  # s3_path: rank 0 copies each committed checkpoint to S3
        if self.save_dir is not None and ck.s3_path:
            require_boto3()
            if is_rank0:
                self.uploads = S3Uploads(ck.s3_path, ck.s3_chunk_size, self.save_dir, line)

    def last_good(self) -> str:
        latest = self.save_dir / "latest" if self.save_dir is not None else None
        if latest is not None and latest.is_file():
            return (
                f"the last good checkpoint is {self.save_dir / (read_latest(self.save_dir) or '')}"
            )
        return "no checkpoint was saved yet"

    def save(self, iteration: int, state: TrainingState) -> Path | None:
        """Save ``state`` at ``iteration`` (a failed write stops the run, the previous
        checkpoint kept), then drop what keep_last_n_checkpoints no longer keeps."""
        if self.save_dir is None:
            return None
        ck = self.ck
        model = get_model_state_dict(state.model)
        if self.lora_base is not None:  # the adapters only: the base is in the one it names
            model = {k: v for k, v in model.items() if trains_with_lora(k)}
        tensors: dict[str, Any] = {"model": model}
        # an optimizer that never stepped has no state to save; asking torch for its state
        # dict would create it with a zero-rate step counted (Adam's bias correction would
        # then be one step off for the rest of the run), so saving never changes training
        if not ck.no_save_optim and state.optimizer.state:
            tensors["optimizer"] = optimizer_state(state.model, state.optimizer, state.by_name)
        if not ck.no_save_rng:
            tensors["rng"] = {"torch": torch.get_rng_state()}
        if state.reference is not None:
            tensors["reference"] = get_model_state_dict(state.reference)
        if state.extra is not None:
            tensors[state.extra.KEY] = state.extra.checkpoint_tensors(not ck.no_save_optim)
        meta = {
            "loaders": {name: loader.state_dict() for name, loader in state.loaders.items()},
            "loss_scaler": state.scaler.state_dict(),
            "has_optimizer": "optimizer" in tensors,
            "has_rng": "rng" in tensors,
            "has_reference": "reference" in tensors,
        }
        if state.extra is not None:
            meta[state.extra.KEY] = state.extra.checkpoint_meta(tensors[state.extra.KEY])
        if self.lora_base is not None:
            meta[LORA_BASE] = self.lora_base
            meta[LORA_BASE_FINGERPRINT] = self.lora_base_fingerprint
        if self.base_shapes is not None:
            meta[BASE_SHAPES] = self.base_shapes
        if self.background is not None:  # async_checkpointing: finished at a later step
            self._finish_background(wait=True)  # the previous one first (uploaded, rotated)
            self.background.start(iteration, tensors, meta)
            return None
        try:
            path = save_checkpoint(self.save_dir, iteration, tensors, self.config_yaml, meta)
        except CheckpointWriteError as e:
            raise TrainingStopped(str(e)) from None
        self._committed(iteration)
        return path

    def poll(self) -> None:
        """Finish a background save whose files every rank has written (at a step boundary)."""
        self._finish_background(wait=False)

    def wait(self) -> None:
        """Wait for a background save in flight and finish it (the run goes on)."""
        if self.background is not None:
            self._finish_background(wait=True)

    def finish(self) -> None:
        """Wait for a background save and finish it, then for the last upload (before the
        run ends)."""
        if self.background is not None:
            self._finish_background(wait=True)
            self.background.close()
        if self.uploads is not None:
            self.uploads.finish()

    def _finish_background(self, wait: bool) -> None:
        """Finish the background save in flight, if any (``wait``: until it is written)."""
        pending = self.background.pending if self.background is not None else None
        if pending is not None and self.background.finish(wait=wait):
            self._committed(pending[0])

    def _committed(self, iteration: int) -> None:
        """A checkpoint is complete: upload it (after the previous upload, so that rotation
        never deletes a directory being uploaded), then rotate."""
        if self.uploads is not None:
            self.uploads.start(self.save_dir / step_dir_name(iteration))
        self._rotate()

    def _rotate(self) -> None:
        keep = self.ck.keep_last_n_checkpoints
        if not keep or self.save_dir is None or not self.is_rank0:
            return
        for _, path in step_dirs(self.save_dir)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)

    def start_dir(
        self, load: str | None, step: int | None, fine_tunes: str | None = None
    ) -> Path | None:
        """What the run starts from: this run's own newest checkpoint when ``save`` holds one
        (rerunning the command resumes it, whatever ``load`` names: the starting point of a
        fresh run only); else the checkpoint ``load`` resumes (or fine-tunes) from, or the
        Hugging Face folder it names (read at step 0); None to start from scratch."""
        own = self.own_checkpoint(load, step)
        if own is not None:
            return own
        if load is None:
            return None
        if is_hf_folder(load):
            return Path(load)
        return self.find(Path(load), step, fine_tunes)

    def own_checkpoint(self, load: str | None, step: int | None) -> Path | None:
        """The checkpoint of this run that ``save`` holds (its ``step``, or the newest
        complete one), when ``load`` names something else; said in the start-up line."""
        save = self.save_dir
        if save is None or not holds_checkpoint(save):
            return None
        if load is not None and Path(load).resolve() == save.resolve():
            return None  # load is save: GPT-NeoX's resume, find() reads it
        if step is None and not (save / "latest").is_file() and newest_complete(save) is None:
            return None  # only a save cut short: nothing of this run to resume
        found = self.find(save, step)
        self.resuming_own = found is not None
        if found is not None:
            start = f"load ({load}) is where a fresh run starts" if load else "load is not set"
            self.line(f"resuming this run from its own checkpoint {found} (save holds it); {start}")
        return found

    def find(self, load_dir: Path, step: int | None, fine_tunes: str | None = None) -> Path | None:
        """The checkpoint a resume from ``load_dir`` loads (its ``step``, the step directory
        it names, or the newest complete one); None when there is none yet (the run starts from
        scratch), unless the run ``fine_tunes`` (see post_training): then a ConfigError."""
        if step is None and (load_dir / META_FILE).is_file():
            return resolve(load_dir)  # load names one step directory
        if step is None and not (load_dir / "latest").is_file():
            # a save killed between its rename and moving 'latest' leaves a complete directory
            newest = newest_complete(load_dir) if load_dir.is_dir() else None
            if newest is None:
                if fine_tunes is not None:
                    raise no_weights_to_fine_tune(load_dir, fine_tunes)
                self.line(f"no checkpoint in {load_dir}: starting from scratch")
                return None
            step = int(newest.name.removeprefix("global_step"))
        return resolve(load_dir, step)

    def resume(self, step_dir: Path, state: TrainingState) -> Resumed:
        """Load the checkpoint ``step_dir`` into ``state``: the weights always; the optimizer,
        RNG, data position and loss scale unless finetune (starting from ``load``, not resuming
        this run's own checkpoint), a weights-only checkpoint or the no_load keys say
        otherwise."""
        ck = self.ck
        meta = read_meta(step_dir)
        try:
            fresh = load_model_weights(step_dir, state.model, line=self.line)
        except OtherModel as e:
            changed = changed_model_keys(step_dir, self.config_yaml)
            if changed:
                raise ConfigError(
                    f"{e.message}: changed since it was saved ({step_dir / CONFIG_FILE}): "
                    f"{', '.join(changed)}; give {'it' if len(changed) == 1 else 'them'} as "
                    "before to resume, or name another save folder",
                    source=e.source,
                ) from None
            if not self.resuming_own:
                raise
            raise ConfigError(
                f"{e.message}: save holds the checkpoint of another model; name another save "
                "folder (or move that one away)",
                source=e.source,
            ) from None
        if any(is_adapter(n) for n, _ in state.model.named_parameters()):
            self.adapt(step_dir)
        for key in [k for k in fresh if not is_adapter(k)]:
            self.line(f"{step_dir} has no {key}: it starts from its initialisation")
        if any(is_adapter(k) for k in fresh):
            self.line(
                f"{step_dir} has no LoRA adapters on {', '.join(adapted_kinds(fresh))}: they "
                "start from their initialisation (B zeros: the model computes what its base does)"
            )
        other = self._other_training(step_dir, state.model, meta)
        if (ck.finetune and not self.resuming_own) or "loaders" not in meta or other:
            why = (
                "finetune is set"
                if ck.finetune
                else other
                or f"it holds weights only ({meta.get('converted_from') or 'no training state'})"
            )
            self.line(
                f"starting at step 0 from the weights of {step_dir}, with a fresh optimizer: {why}"
            )
            return Resumed(step_dir, 0, training_state=False)
        reference = self._load_training_state(step_dir, meta, state)
        return Resumed(step_dir, int(meta["iteration"]), True, reference)

    def adapt(self, step_dir: Path) -> None:
        """A LoRA run loaded ``step_dir``: what its adapters-only saves name as their base
        (``base_of_adapters``), and its fingerprint."""
        self.lora_base = base_of_adapters(step_dir, self.save_dir)
        self.lora_base_fingerprint = (
            base_fingerprint(Path(self.lora_base)) if self.lora_base is not None else None
        )

    def _other_training(self, step_dir: Path, model: torch.nn.Module, meta: dict) -> str | None:
        """Why ``step_dir``'s training state is another kind of run's than this one (a LoRA
        run from a checkpoint without adapters, or with adapters on fewer layers; a run
        without lora from one with them): its optimizer holds other parameters, so the run
        starts from its weights, with a fresh optimizer. None when it is this kind's; refused
        when it is this run's own checkpoint (lora changed between two runs of one command)."""
        held = adapted_kinds(held_adapters(step_dir))
        ours = adapted_kinds(n for n, _ in model.named_parameters())
        if "loaders" not in meta or held == ours or (self.ck.finetune and not self.resuming_own):
            return None
        if self.resuming_own:
            raise ConfigError(
                f"save holds this run's own checkpoint {step_dir}, trained with adapters on "
                f"{', '.join(held) or 'no layer'}, the config's lora on "
                f"{', '.join(ours) or 'none'}: give lora as it was to resume it, or name "
                "another save folder",
                key="lora",
            )
        if not ours:
            return "its adapters are merged (its optimizer state is of a LoRA run's adapters)"
        new = ", ".join(k for k in ours if k not in held)
        return f"lora trains new adapters on {new} (its optimizer state is of " + (
            f"the adapters on {', '.join(held)})" if held else "a run without lora)"
        )

    def _extra_template(self, step_dir: Path, meta: dict, state: TrainingState) -> Any:
        """The tensors to read the checkpoint's part of ``state.extra`` into (None: the
        checkpoint holds none, said in one line, or the run has none)."""
        extra = state.extra
        if extra is None and DILOCO in meta:
            self.line(
                f"{step_dir} holds DiLoCo's outer state, unused by this run (no "
                "ft_diloco_sync_every): it goes on from that step's weights"
            )
        if extra is None or extra.KEY not in meta:
            if extra is not None:
                self.line(f"{step_dir} holds no {extra.KEY} state: it starts afresh here")
            return None
        return extra.template(meta[extra.KEY], not self.ck.no_load_optim)

    def _load_training_state(self, step_dir: Path, meta: dict, state: TrainingState) -> bool:
        """Whether the reference model's weights were loaded too."""
        then = meta.get(BASE_SHAPES)
        if then is not None and self.base_shapes is not None and then != self.base_shapes:
            raise ConfigError(
                f"changed since {step_dir} was saved (muP's multipliers come from it): put back "
                "the file the run was trained with, or start a new run in another save folder",
                source=then["path"],
                key="base_shapes_file",
            )
        ck, loaded_reference = self.ck, False
        tensors: dict[str, Any] = {}
        flat = False
        if not ck.no_load_optim and meta.get("has_optimizer", False):
            if hasattr(state.optimizer, "init_state"):  # SM3, madgrad_wd, LAMB (see there)
                state.optimizer.init_state()
            flat = not numbered_optimizer_groups(step_dir)
            tensors["optimizer"] = optimizer_state(state.model, state.optimizer, flat)
        if not ck.no_load_rng and meta.get("has_rng", False):
            tensors["rng"] = {"torch": torch.get_rng_state()}
        extra = self._extra_template(step_dir, meta, state)
        if extra is not None:
            tensors[state.extra.KEY] = extra
        try:
            if tensors:
                load_state(step_dir, tensors)
            if "optimizer" in tensors:
                load_optimizer_state(state.model, state.optimizer, tensors["optimizer"], flat)
        except (RuntimeError, ValueError, KeyError, CheckpointException) as e:
            if "optimizer" not in tensors:
                raise
            raise ConfigError(
                f"its optimizer state does not fit this run's optimizer ({first_line(e)[:160]}): "
                "the optimizer (or use_bnb_optimizer) changed since it was saved; resume with the "
                "settings it was saved with, set no_load_optim: true to keep its weights with a "
                "fresh optimizer, or name another save folder",
                source=str(step_dir),
            ) from None
        if "rng" in tensors:
            torch.set_rng_state(tensors["rng"]["torch"])
        if extra is not None:
            state.extra.resume(extra, meta[state.extra.KEY])
        if state.reference is not None and meta.get("has_reference", False):
            load_model_weights(step_dir, state.reference, prefix="reference")
            loaded_reference = True
        for name, loader in state.loaders.items():
            if name in meta["loaders"]:
                loader.load_state_dict(meta["loaders"][name])
        if "loss_scaler" in meta:
            state.scaler.load_state_dict(meta["loss_scaler"])
        return loaded_reference
