"""Config groups of what goes in and out: data, tokenizer, logging, generation, launching."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torchneox.config.fields import derived, extension, key, no_effect, unsupported

LAUNCH = "torchneox is launched with torchrun; this describes DeepSpeed's launcher"
DS_ONLY = "a DeepSpeed setting with no counterpart in a PyTorch-native trainer"
WANDB = "only used with use_wandb"


@dataclass
class DataConfig:
    """Token datasets, their split and their blend."""

    data_path: str | None = key(
        None,
        "Prefix of one .bin/.idx dataset, or raw text streamed (jsonl, parquet, arrow, a folder, "
        "a datasets folder, hf://NAME), split by 'split'.",
    )
    split: str = key("969, 30, 1", "Train, validation, test proportions of data_path's documents.")
    train_data_paths: list[str] | None = key(None, "Training dataset prefixes, blended.")
    valid_data_paths: list[str] | None = key(None, "Validation dataset prefixes, blended.")
    test_data_paths: list[str] | None = key(None, "Test dataset prefixes, blended.")
    train_data_weights: list[float] | None = key(None, "Blend weights of train_data_paths.")
    valid_data_weights: list[float] | None = key(None, "Blend weights of valid_data_paths.")
    test_data_weights: list[float] | None = key(None, "Blend weights of test_data_paths.")
    weight_by_num_documents: bool = key(
        False, "Weight datasets by document count (tempered by weighted_sampler_alpha)."
    )
    weighted_sampler_alpha: float = key(
        1.0, "Exponent on document-count weights; below 1 favours small datasets.", gt=0
    )
    data_impl: Literal["infer", "mmap", "cached"] = key(
        "infer",
        "Dataset format: mmap (MMIDIDX) or cached (Megatron's older TNTIDX index, which "
        "GPT-NeoX's training cannot read at ea7aefd); torchneox reads whichever format the .idx "
        "holds, as infer does.",
    )
    pack_impl: Literal["packed", "pack_until_overflow", "unpacked"] = key(
        "packed",
        "How documents fill samples: packed (concatenated and cut), unpacked (one document "
        "per sample, padded) or pack_until_overflow (whole documents while they fit).",
    )
    dataset_impl: Literal["gpt2", "pairwise", "online"] = key(
        "gpt2",
        "Dataset kind: gpt2 (documents, with label and reward datasets) or pairwise (chosen "
        "and rejected documents, for dpo and rm) or online (REINFORCE's rollouts from data "
        "servers, online_dataserver_ips/ports).",
    )
    allow_chopped: bool = key(
        True,
        "Unpacked and pack_until_overflow data: keep documents longer than a sample (cut); "
        "false leaves them out.",
    )
    num_workers: int = key(
        2,
        "Background processes that prepare batches (streamed sources: that tokenize them).",
        ge=0,
    )
    jsonl_keys: list[str] = extension(
        ["text"],
        "Streamed sources: the field (jsonl key, parquet/arrow column) holding each document's "
        "text, as preprocess's --jsonl-keys chooses it; one.",
    )
    stream_shuffle: bool = extension(
        True,
        "Streamed sources: files, row groups and documents (in a bounded buffer) shuffled by "
        "the seed each epoch; false reads them in order.",
    )
    stream_shuffle_buffer: int = extension(
        1024, "Streamed sources: documents shuffled together (and held in memory) at a time.", ge=1
    )
    skip_bad_records: bool = extension(
        False,
        "Streamed sources: skip (and count) records that are not JSON, lack the text field or "
        "are not UTF-8, instead of stopping the run at the first.",
    )
    use_shared_fs: bool = key(
        True, "Index files are built once on a shared filesystem (else once per node)."
    )
    mmap_warmup: bool = no_effect(
        False,
        "Read datasets once at start-up to warm the page cache.",
        "the OS page cache warms itself",
    )
    train_label_data_paths: list[str] | None = key(
        None, "Label datasets of train_data_paths (the token learnt at each position, -100: none)."
    )
    valid_label_data_paths: list[str] | None = key(None, "Label datasets of valid_data_paths.")
    test_label_data_paths: list[str] | None = key(None, "Label datasets of test_data_paths.")
    train_reward_data_paths: list[str] | None = key(
        None, "Reward datasets of train_data_paths (one value per document, for kto)."
    )
    valid_reward_data_paths: list[str] | None = key(None, "Reward datasets (valid).")
    test_reward_data_paths: list[str] | None = key(None, "Reward datasets (test).")
    pos_train_data_paths: list[str] | None = key(
        None, "Chosen documents of the pairs (train; dataset_impl pairwise)."
    )
    neg_train_data_paths: list[str] | None = key(
        None, "Rejected documents of the pairs (train; dataset_impl pairwise)."
    )
    pos_valid_data_paths: list[str] | None = key(
        None, "Chosen documents of the pairs (valid; dataset_impl pairwise)."
    )
    neg_valid_data_paths: list[str] | None = key(
        None, "Rejected documents of the pairs (valid; dataset_impl pairwise)."
    )
    pos_test_data_paths: list[str] | None = key(
        None, "Chosen documents of the pairs (test; dataset_impl pairwise)."
    )
    neg_test_data_paths: list[str] | None = key(
        None, "Rejected documents of the pairs (test; dataset_impl pairwise)."
    )
    pos_train_label_data_paths: list[str] | None = key(
        None, "Labels of the chosen documents (train)."
    )
    neg_train_label_data_paths: list[str] | None = key(
        None, "Labels of the rejected documents (train)."
    )
    pos_valid_label_data_paths: list[str] | None = key(
        None, "Labels of the chosen documents (valid)."
    )
    neg_valid_label_data_paths: list[str] | None = key(
        None, "Labels of the rejected documents (valid)."
    )
    pos_test_label_data_paths: list[str] | None = key(
        None, "Labels of the chosen documents (test)."
    )
    neg_test_label_data_paths: list[str] | None = key(
        None, "Labels of the rejected documents (test)."
    )


@dataclass
class TokenizerConfig:
    """The tokenizer and the vocabulary size it implies."""

    tokenizer_type: Literal[
        "GPT2BPETokenizer",
        "HFTokenizer",
        "HFGPT2Tokenizer",
        "SPMTokenizer",
        "CharLevelTokenizer",
        "TiktokenTokenizer",
    ] = key("GPT2BPETokenizer", "Tokenizer kind.")
    vocab_file: str | None = key(
        None, "Tokenizer file: vocab.json, tokenizer.json, a sentencepiece or tiktoken model."
    )
    merge_file: str | None = key(None, "BPE merges file (GPT2BPETokenizer).")
    padded_vocab_size: int | None = derived(
        None, "Embedding rows after padding; derived from the tokenizer unless given."
    )


@dataclass
class LoggingConfig:
    """Console, metrics files, TensorBoard, W&B and profiling."""

    log_interval: int = key(100, "Steps between log lines.", ge=1)
    steps_per_print: int = no_effect(
        10, "DeepSpeed's own loss print interval.", "log_interval sets the log cadence"
    )
    log_dir: str | None = key(None, "Directory of metrics.jsonl; defaults to the save directory.")
    tensorboard_dir: str | None = key(None, "Write TensorBoard events here.")
    use_wandb: bool | None = key(None, "Log to Weights & Biases.")
    wandb_project: str = key("neox", "W&B project.")
    wandb_group: str | None = key(None, "W&B run group.")
    wandb_team: str | None = key(None, "W&B entity.")
    wandb_host: str = key("https://api.wandb.ai", "W&B server.")
    wandb_run_name: str | None = key(None, "W&B run name; unset lets W&B pick one.")
    wandb_init_all_ranks: bool = no_effect(
        False,
        "Start W&B on every rank, not only rank 0.",
        "only rank 0 logs, with the reduced metrics",
    )
    wall_clock_breakdown: bool = key(
        False, "Print data, forward, backward and optimizer timings every log step."
    )
    memory_profiling: bool = key(False, "Record a CUDA memory snapshot for the profiled steps.")
    memory_profiling_path: str | None = key(None, "Where the memory snapshot goes.")
    profile: bool = key(False, "Record a torch profiler trace for the profiled steps.")
    profile_step_start: int = key(10, "First profiled step.", ge=0)
    profile_step_stop: int = key(12, "Last profiled step.", ge=0)
    log_grad_norm: bool = no_effect(
        False, "Log the gradient norm.", "the global gradient norm is always logged"
    )
    log_param_norm: bool = no_effect(
        False, "Log parameter norms.", "per-parameter norms are not logged yet"
    )
    log_grad_pct_zeros: bool = no_effect(
        False,
        "Log the share of zero gradients.",
        "per-parameter gradient statistics are not logged yet",
    )
    log_optimizer_states: bool = no_effect(
        False, "Log optimizer state norms.", "optimizer state norms are not logged yet"
    )
    log_gradient_noise_scale: bool = no_effect(
        False, "Log the gradient noise scale.", "the gradient noise scale is not measured yet"
    )
    gradient_noise_scale_n_batches: int = no_effect(
        5, "Batches per noise-scale estimate.", "the gradient noise scale is not measured yet"
    )
    gradient_noise_scale_cpu_offload: bool = no_effect(
        False,
        "Keep noise-scale buffers on the CPU.",
        "the gradient noise scale is not measured yet",
    )
    use_comet: bool | None = key(
        None,
        "Log to Comet (needs the comet_ml package; COMET_API_KEY, or COMET_MODE=offline for a "
        "local archive).",
    )
    comet_workspace: str | None = key(None, "Comet workspace.")
    comet_project: str | None = key(None, "Comet project.")
    comet_experiment_name: str | None = key(None, "Comet experiment name.")
    comet_tags: list[str] | None = key(None, "Comet tags.")
    comet_others: dict[str, Any] | None = key(
        None, "Other metadata logged to the Comet experiment."
    )
    comet_experiment: Any = no_effect(
        None,
        "GPT-NeoX's live Comet experiment object.",
        "GPT-NeoX fills it in at launch with the experiment it started; a config value is not read",
    )
    git_hash: str | None = derived(None, "Git commit of the code that ran.")
    peak_theoretical_tflops: float | None = key(
        None,
        "Peak TFLOP/s of one device for MFU; unset: the accelerator table, or measured on CPU.",
        gt=0,
    )


@dataclass
class TextGenConfig:
    """Sampling and evaluation."""

    text_gen_type: Literal["unconditional", "input-file", "interactive", "precompute"] | None = key(
        None,
        "Generation mode: unconditional, input-file, interactive, or precompute (a reference "
        "model's log-probabilities of the training data, for DPO and KTO).",
    )
    temperature: float = key(0.0, "Sampling temperature; 0 means greedy.", ge=0)
    top_k: int = key(0, "Sample among the k most likely tokens; 0 means no limit.", ge=0)
    top_p: float = key(
        0.0,
        "Sample among the most likely tokens covering this probability; 0 means off.",
        ge=0,
        le=1,
    )
    maximum_tokens: int = key(
        64,
        "Most tokens generated per prompt; never past the model's last position (as GPT-NeoX).",
        ge=1,
    )
    prompt_end: str = key("\n", "What ends one prompt in interactive and input-file modes.")
    sample_input_file: str | None = key(None, "Prompts, one per line (input-file mode).")
    sample_output_file: str = key("samples.txt", "Where generations are written.")
    num_samples: int = key(1, "Samples drawn in unconditional mode.", ge=1)
    recompute: bool = key(False, "Recompute attention over the whole text each step (no KV cache).")
    decode_loop: Literal["auto", "static", "dynamic"] = extension(
        "auto",
        "How generate decodes with the KV cache: static (fixed-shape steps over a preallocated "
        "cache, replayed as a CUDA graph on a GPU, no host read per token), dynamic (each step "
        "attends over the keys so far), auto (static on CUDA, dynamic on the CPU). Both give "
        "the same tokens.",
    )
    speculative: bool = extension(
        False,
        "Greedy decoding that drafts with the model's first multi-token prediction module "
        "(mtp_num_layers): each forward of the model checks the draft of the token after next "
        "and keeps it when the head agrees, so up to two tokens a forward, the tokens those of "
        "plain greedy decoding. Needs temperature 0, the KV cache and attention layers.",
    )
    return_logits: bool = no_effect(
        False,
        "Also return the logits of generated tokens.",
        "generate writes text; logits are not returned",
    )
    precompute_model_name: str | None = key(
        None,
        "Suffix of the precomputed reference log-probabilities (DATASET_{name}); set in a dpo or "
        "kto config, training reads them instead of running a reference model.",
    )
    eval_tasks: list[str] | None = key(
        None, "lm-evaluation-harness tasks run at eval_interval (needs the lm-eval package)."
    )
    eval_tasks_include_path: str | None = extension(
        None, "Folder of extra lm-eval task YAML files for eval_tasks (local tasks)."
    )
    eval_tasks_limit: float | None = extension(
        None,
        "Documents per task for eval_tasks during training (a fraction if < 1); all if unset.",
        gt=0,
    )
    eval_results_prefix: str = no_effect(
        "", "Prefix of evaluation result files.", "evaluations go to metrics.jsonl"
    )


@dataclass
class LauncherConfig:
    """GPT-NeoX's DeepSpeed launcher settings (torchneox is launched with torchrun)."""

    hostfile: str | None = key(
        None, "File of 'host slots=N' lines; config explain turns it into the torchrun command."
    )
    include: str | None = no_effect(None, "Hosts and GPUs to use.", LAUNCH)
    exclude: str | None = no_effect(None, "Hosts and GPUs to leave out.", LAUNCH)
    num_nodes: int = key(-1, "Nodes to run on; -1 means all.")
    num_gpus: int | None = key(None, "GPUs per node.", ge=1)
    master_port: int = key(
        29500, "Rendezvous port, used in the torchrun command explain prints.", ge=1, le=65535
    )
    master_addr: str | None = key(
        None, "Rendezvous host (default: the hostfile's first host), used in the torchrun command."
    )
    launcher: Literal["pdsh", "openmpi", "mvapich", "slurm"] = no_effect(
        "pdsh", "DeepSpeed's multi-node launcher.", LAUNCH
    )
    force_multi: bool = no_effect(False, "Force multi-node mode.", LAUNCH)
    autotuning_run: str | None = no_effect(None, "DeepSpeed autotuning mode.", LAUNCH)
    no_ssh_check: bool = no_effect(False, "Skip DeepSpeed's ssh check.", LAUNCH)
    comment: str | None = no_effect(None, "Slurm comment passed by DeepSpeed.", LAUNCH)
    account: str | None = no_effect(None, "Slurm account passed by DeepSpeed.", LAUNCH)
    deepspeed_mpi: bool = no_effect(False, "Discover ranks from MPI.", LAUNCH)
    deepspeed_slurm: bool = no_effect(False, "Discover ranks from Slurm.", LAUNCH)
    user_script: str | None = derived(None, "Script the launcher runs.")


@dataclass
class DeepSpeedConfig:
    """DeepSpeed-only settings: accepted so GPT-NeoX configs load, none needed here."""

    deepspeed: bool = no_effect(True, "Use DeepSpeed.", "torchneox runs on PyTorch alone")
    deepscale: bool = no_effect(False, "Old DeepSpeed flag.", DS_ONLY)
    deepscale_config: str | None = no_effect(None, "Old DeepSpeed config file.", DS_ONLY)
    deepspeed_extra_args: dict[str, Any] | None = no_effect(
        None, "Extra DeepSpeed config.", DS_ONLY
    )
    dump_state: bool = no_effect(False, "Print DeepSpeed's state.", DS_ONLY)
    sparse_gradients: bool = no_effect(False, "Sparse embedding gradients.", DS_ONLY)
    flops_profiler: dict[str, Any] | None = no_effect(
        None, "DeepSpeed FLOPs profiler.", "TFLOP/s and MFU are always logged"
    )
    autotuning: dict[str, Any] | None = no_effect(None, "DeepSpeed autotuning.", DS_ONLY)
    activation_checkpointing: dict[str, Any] | None = no_effect(
        None,
        "DeepSpeed activation checkpointing settings.",
        "use checkpoint_activations and checkpoint_num_layers",
    )
    tensorboard: dict[str, Any] | None = no_effect(
        None, "DeepSpeed's TensorBoard monitor.", "use tensorboard_dir"
    )
    wandb: dict[str, Any] | None = no_effect(None, "DeepSpeed's W&B monitor.", "use use_wandb")
    csv_monitor: dict[str, Any] | None = no_effect(
        None, "DeepSpeed's CSV monitor.", "metrics.jsonl is always written"
    )
    comms_logger: dict[str, Any] | None = no_effect(None, "DeepSpeed's comms logger.", DS_ONLY)
    checkpoint: dict[str, Any] | None = no_effect(None, "DeepSpeed checkpoint options.", DS_ONLY)
    data_types: dict[str, Any] | None = no_effect(
        None,
        "DeepSpeed gradient accumulation dtype.",
        "gradients accumulate in the master weights' dtype",
    )
    elasticity: dict[str, Any] | None = unsupported(
        None,
        "DeepSpeed elastic training.",
        "DeepSpeed elasticity is not supported; use torchrun --nnodes MIN:MAX",
    )
    sparse_attention: dict[str, Any] | None = no_effect(
        None,
        "DeepSpeed sparse attention.",
        "DeepSpeed only parses it; block-sparse layers come from attention_config and "
        "sparsity_config",
    )
    data_efficiency: dict[str, Any] | None = key(
        None,
        "DeepSpeed data efficiency: data_sampling.curriculum_learning's seqlen_truncate metric "
        "is the sequence-length curriculum (as curriculum_learning); other metrics and "
        "data_routing (random-LTD) are DeepSpeed-only and refused.",
    )
    compression_training: dict[str, Any] | None = unsupported(
        None, "DeepSpeed compression.", "DeepSpeed compression training is not supported"
    )


@dataclass
class RuntimeConfig:
    """Values GPT-NeoX writes while it runs; accepted when a saved config carries them."""

    iteration: int | None = derived(None, "Current step.")
    do_train: bool | None = derived(None, "Whether a training split exists.")
    do_valid: bool | None = derived(None, "Whether a validation split exists.")
    do_test: bool | None = derived(None, "Whether a test split exists.")
    save_iters: list[int] | None = derived(None, "Steps at which checkpoints are saved.")
