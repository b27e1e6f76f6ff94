"""Whether a run fine-tunes the weights it loads, the refusal of one with nothing to load, and
where a resume left the run (``Resumed``): read by the trainer and, before any process starts,
by ``train --nproc``'s launcher, which must not import torch for it (this module does not)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchneox.base.errors import ConfigError
from torchneox.config.paths import dataset_files, refuse_overlap
from torchneox.models.hf.folder import is_hf_folder

PEFT_CONFIG = "adapter_config.json"
"""What a PEFT adapter folder holds beside its tensors."""


def holds_checkpoint(load_dir: Path) -> bool:
    """A save directory (its ``latest`` or a ``global_stepN`` folder) or one checkpoint (its
    meta.json): checkpoint_format's names, read without torch."""
    if (load_dir / "latest").is_file() or (load_dir / "meta.json").is_file():
        return True
    return load_dir.is_dir() and any(
        p.is_dir() and p.name.removeprefix("global_step").isdigit()
        for p in load_dir.glob("global_step*")
    )


def post_training(cfg: Any) -> str | None:
    """What makes a run fine-tune the weights it loads (a DPO, KTO or reward-model objective,
    finetune, or SFT's label datasets), in words; None for pretraining."""
    impl = cfg.training.train_impl
    if impl != "normal":
        return f"train_impl {impl}"
    if cfg.checkpoint.finetune:
        return "finetune: true"
    if cfg.data.train_label_data_paths:
        return "supervised fine-tuning (train_label_data_paths)"
    return None


def no_weights_to_fine_tune(
    load_dir: Path, fine_tunes: str, source: str | None = None
) -> ConfigError:
    reference = " and its reference" if fine_tunes in ("train_impl dpo", "train_impl kto") else ""
    return ConfigError(
        f"{load_dir} holds no checkpoint, and {fine_tunes} fine-tunes the weights it loads "
        f"(the policy{reference} would start from random weights): point load at the model to "
        "start from (convert from-hf or from-gpt-neox writes one), or set load: null to train "
        "from random weights",
        source=source,
        key="load",
    )


def refuse_fine_tuning_nothing(loaded: Any) -> None:
    """Before anything is built or started: a post-training run whose ``load`` holds no
    checkpoint, and whose ``save`` holds none of its own to resume, is refused in one line (a
    pretraining run starts from scratch, as in GPT-NeoX)."""
    cfg = loaded.config
    fine_tunes = post_training(cfg)
    if cfg.checkpoint.load is None:
        return
    if cfg.checkpoint.save is not None and holds_checkpoint(Path(cfg.checkpoint.save)):
        return  # the run resumes its own checkpoint (CheckpointManager.start_dir)
    load_dir = Path(cfg.checkpoint.load)
    if (load_dir / PEFT_CONFIG).is_file() and not holds_checkpoint(load_dir):
        raise ConfigError(
            f"{load_dir} is a PEFT adapter folder, which load does not read (it holds no base "
            f"weights): convert from-hf BASE_HF_DIR OUT --adapter {load_dir} writes a "
            "checkpoint of the base with these adapters; load that",
            source=loaded.source("load"),
            key="load",
        )
    if fine_tunes is None:
        return
    if not holds_checkpoint(load_dir) and not is_hf_folder(load_dir):
        raise no_weights_to_fine_tune(load_dir, fine_tunes, loaded.source("load"))


def refuse_saving_over_inputs(loaded: Any) -> None:
    """``save`` that is, holds or lies inside what the run reads (its config files, data,
    tokenizer, or the Hugging Face folder ``load`` names) is refused before anything starts:
    checkpoints are never written into an input (``load`` equal to ``save`` is GPT-NeoX's
    resume, and stays allowed for a checkpoint folder)."""
    cfg = loaded.config
    if not cfg.checkpoint.save:
        return
    tok = cfg.tokenizer
    inputs = [*loaded.files, *dataset_files(cfg.data), tok.vocab_file, tok.merge_file]
    if cfg.checkpoint.load and is_hf_folder(cfg.checkpoint.load):
        inputs.append(cfg.checkpoint.load)
    refuse_overlap([Path(cfg.checkpoint.save)], inputs, "train (save)")


@dataclass
class Resumed:
    """Where a resume left the run."""

    step_dir: Path
    iteration: int
    training_state: bool  # False: weights only (finetune, or a converted checkpoint)
    reference: bool = False  # the reference model's weights were loaded
