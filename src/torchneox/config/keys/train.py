"""Config groups of the training run: parallel layout, optimizer, schedule, precision, loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torchneox.config.fields import derived, extension, key, no_effect

CKPT_SAME = "torch's activation checkpointing needs no such tuning"
DEEPSPEED_ZERO = "DeepSpeed ZeRO tuning; the ZeRO stage comes from zero_optimization.stage"


@dataclass
class ParallelConfig:
    """How the run is laid out over processes."""

    pipe_parallel_size: int = key(
        0,
        "Pipeline stages: 0 and 1 run one stage as a plain module; 2 or more run a schedule.",
        ge=0,
    )
    model_parallel_size: int = key(1, "Tensor-parallel ranks that split each layer.", ge=1)
    sequence_parallel: bool = key(
        False, "With tensor parallelism, also split norms and dropout along the sequence."
    )
    context_parallel_size: int = extension(
        1,
        "Context-parallel ranks that split every sample's sequence (load-balanced chunks; each "
        "attention layer gathers the keys and values of the whole sequence).",
        ge=1,
    )
    pipe_partition_method: str = key(
        "type:transformer|mlp",
        "How layers are spread over pipeline stages: 'type:REGEX', 'parameters' or 'uniform'.",
    )
    pipeline_schedule: Literal[
        "1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv"
    ] = extension(
        "1f1b", "Pipeline schedule when pipe_parallel_size >= 2 (torch.distributed.pipelining)."
    )
    pipeline_virtual_stages: int = extension(
        2,
        "Stages per rank for interleaved_1f1b, looped_bfs and interleaved_zero_bubble (zbv uses 2).",
        ge=1,
    )
    distributed_backend: str = key(
        "nccl", "Collective backend; torchneox uses gloo on CPU whatever this says."
    )
    distributed_timeout_minutes: float = extension(
        30.0, "How long a collective may wait for a rank before the run stops with an error.", gt=0
    )
    world_size: int | None = derived(None, "Total processes; taken from the launcher.", ge=1)
    global_num_gpus: int | None = derived(
        None,
        "Total GPUs GPT-NeoX launched on; used as the world size when no launcher gives one.",
        ge=1,
    )
    is_pipe_parallel: bool = derived(
        False,
        "Whether GPT-NeoX uses its pipeline engine; torchneox decides from pipe_parallel_size.",
    )
    local_rank: int | None = derived(None, "Rank on this node; taken from the launcher.")
    rank: int | None = derived(None, "Global rank; taken from the launcher.")
    lazy_mpu_init: bool = no_effect(
        False, "Megatron's deferred initialisation hook.", "process groups are set up by torchrun"
    )


@dataclass
class OptimizerConfig:
    """The optimizer, weight decay, clipping and ZeRO sharding."""

    optimizer: dict[str, Any] | None = key(
        None,
        "{type: Adam|AdamW|SGD|Lion|SM3|madgrad_wd|LAMB|cpu_adam|cpu_torch_adam|muon, params: "
        "{lr, betas, eps, momentum, ...}} (docs/training.md lists each one's params; muon is a "
        "torchneox type: Muon on the blocks' matrices, AdamW on the rest).",
    )
    weight_decay: float = key(
        0.1, "Decoupled weight decay on weight matrices (never on biases and norms).", ge=0
    )
    gradient_clipping: float = key(
        1.0, "Clip gradients to this global L2 norm; 0 turns it off.", ge=0
    )
    clip_grad: float = key(1.0, "Megatron's name for gradient_clipping.", ge=0)
    zero_optimization: dict[str, Any] | None = key(
        None,
        "ZeRO settings: 'stage' (0-3), mics_shard_size, and offload_optimizer / offload_param "
        "{device: cpu} (or cpu_offload: true): ZeRO-Offload through FSDP2's CPU offload.",
    )
    optimizer_type: Literal[
        "adam",
        "onebitadam",
        "cpu_adam",
        "cpu_torch_adam",
        "sm3",
        "madgrad_wd",
        "sgd",
        "lion",
        "lamb",
        "muon",
    ] = derived("adam", "Optimizer name, taken from optimizer.type.")
    lr: float | None = derived(None, "Peak learning rate, taken from optimizer.params.lr.", gt=0)
    zero_stage: int | list[int] | str | None = derived(
        None, "ZeRO stage, taken from zero_optimization.stage."
    )
    zero_reduce_scatter: bool | None = no_effect(None, "Reduce-scatter gradients.", DEEPSPEED_ZERO)
    zero_contiguous_gradients: bool | None = no_effect(
        None, "Copy gradients into one buffer.", DEEPSPEED_ZERO
    )
    zero_reduce_bucket_size: int | None = no_effect(
        None, "Elements reduced at a time.", DEEPSPEED_ZERO
    )
    zero_allgather_bucket_size: int | None = no_effect(
        None, "Elements gathered at a time.", DEEPSPEED_ZERO
    )
    use_bnb_optimizer: bool = key(
        False,
        "Adam with 8-bit moments (ZeRO 0 over plain tensors: bitsandbytes' Adam8bit, else "
        "torchao's AdamW8bit; ZeRO 1-3, tensor, pipeline and expert parallelism: torchao's, over "
        "each rank's part) and learned position embeddings as StableEmbedding (a LayerNorm "
        "after the lookup).",
    )
    scheduler: dict[str, Any] | None = no_effect(
        None,
        "A DeepSpeed LR scheduler.",
        "GPT-NeoX hands DeepSpeed its own schedule, which wins over this dict; the schedule "
        "comes from lr_decay_style, warmup and min_lr",
    )


@dataclass
class LRConfig:
    """The learning-rate schedule."""

    lr_decay_style: Literal[
        "constant", "linear", "cosine", "exponential", "wsd", "infinite_cosine",
        "infinite_inv_sqrt",
    ] = key(
        "linear",
        "Shape of the decay after warmup; wsd (GPT-NeoX PR #1375): hold the peak, then a half "
        "cosine to min_lr over the last wsd_decay_ratio of the steps; infinite_cosine and "
        "infinite_inv_sqrt (GPT-NeoX PR #1194): cool down to constant_lr, hold, then decay "
        "exponentially to min_lr.",
    )  # fmt: skip
    wsd_decay_ratio: float = extension(
        0.1,
        "lr_decay_style wsd (GPT-NeoX PR #1375): the share of the steps after warmup that "
        "decay to min_lr; the others hold the peak.",
        ge=0,
        le=1,
    )
    lr_decay_iters: int | None = key(None, "Steps the decay spans; defaults to train_iters.", ge=1)
    lr_decay_fraction: float | None = key(
        None,
        "Decay over this fraction of train_iters (lr_decay_iters wins when both are set).",
        gt=0,
        le=1,
    )
    min_lr: float = key(0.0, "Floor of the learning rate.", ge=0)
    constant_lr: float = extension(
        0.0,
        "infinite_cosine/infinite_inv_sqrt (GPT-NeoX PR #1194): the rate the cooldown reaches "
        "and holds.",
        ge=0,
    )
    cooldown_iters_perc: float = extension(
        0.0,
        "infinite_* (GPT-NeoX PR #1194): the cooldown's share of lr_decay_iters.",
        ge=0,
        le=1,
    )
    constant_iters_perc: float = extension(
        0.0,
        "infinite_* (GPT-NeoX PR #1194): the share of lr_decay_iters held at constant_lr.",
        ge=0,
        le=1,
    )
    timescale: float = extension(
        1.0,
        "infinite_inv_sqrt (GPT-NeoX PR #1194): the steepness of the inverse square root cooldown.",
        gt=0,
    )
    warmup: float = key(0.01, "Linear warmup over this fraction of the decay steps.", ge=0, le=1)
    override_lr_scheduler: bool = key(
        False,
        "On resume, take the schedule from the config, not the checkpoint (torchneox's default).",
    )
    use_checkpoint_lr_scheduler: bool = key(
        False, "On resume, take the schedule from the checkpoint, not the config."
    )
    hold_lr_after_decay: bool = extension(
        False,
        "Past lr_decay_iters, keep the rate where the decay ended; false (GPT-NeoX): keep "
        "evaluating the decay formula (cosine climbs back up, exponential falls to min_lr).",
    )


@dataclass
class PrecisionConfig:
    """Number formats and loss scaling."""

    precision: Literal["fp16", "fp32", "bfloat16"] | None = key(
        None, "fp32, bfloat16 or fp16; unset means whatever the fp16/bf16 dicts enable, else fp32."
    )
    fp16: dict[str, Any] | None = key(
        None,
        "DeepSpeed fp16 dict: enabled, loss_scale (0 = dynamic), initial_scale_power, "
        "loss_scale_window, hysteresis, min_loss_scale.",
    )
    bf16: dict[str, Any] | None = key(None, "DeepSpeed bf16 dict: enabled.")
    amp: dict[str, Any] | None = key(
        None,
        "Apex AMP dict (DeepSpeed runs it without fp16/bf16 and ZeRO): enabled with opt_level "
        "O1/O2 trains in fp16 with fp32 master weights and apex's dynamic loss scale "
        "(loss_scale, min_loss_scale); O0 is fp32; O3 is refused.",
    )
    loss_scale: float | None = key(
        None, "Static fp16 loss scale; unset (or 0) means dynamic scaling.", ge=0
    )
    dynamic_loss_scale: bool | None = derived(None, "Whether the fp16 loss scale is dynamic.")
    hysteresis: int = key(2, "Overflows tolerated before the dynamic loss scale drops.", ge=1)
    loss_scale_window: float = key(
        1000.0, "Clean steps before the dynamic loss scale doubles.", gt=0
    )
    min_scale: float = key(1.0, "Lowest dynamic loss scale.", gt=0)
    fp32_allreduce: bool = key(False, "Average gradients across ranks in fp32.")
    communication_data_type: str | None = key(
        None, "Dtype of gradient reduction (fp32, bf16, fp16); unset follows precision."
    )
    prescale_gradients: bool = no_effect(
        False, "Scale gradients before the all-reduce.", "FSDP2/DDP average gradients themselves"
    )
    gradient_predivide_factor: float = no_effect(
        1.0,
        "Divide gradients by this before the all-reduce.",
        "FSDP2/DDP average gradients themselves",
    )
    zero_param_dtype: Literal["auto", "fp32", "bf16"] = extension(
        "auto",
        "Dtype ZeRO's sharded weights are gathered in for forward and backward (FSDP2's "
        "mixed precision; fp32 master weights stay sharded): auto is bf16 when training in "
        "bfloat16 (half the gather, weights cast once per step, as DeepSpeed's bf16 weights), "
        "else fp32. ZeRO 0 (DDP) keeps fp32 weights that autocast casts at each use.",
    )
    fp8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = extension(
        None,
        "fp8 training of every block linear through torchao's float8 with this recipe "
        "(needs torchao; a GPU of compute capability 8.9+, or the CPU; under tensor "
        "parallelism the layers split with torchao's float8 styles). Unset: no fp8 unless "
        "te_fp8_mha.",
    )
    cpu_matmul: Literal["auto", "onednn", "default"] = extension(
        "auto",
        "Kernel of the fp32 CPU linears: auto (per shape oneDNN where it is clearly faster "
        "than PyTorch's default, timed per machine and cached; `torchneox kernels` shows the "
        "verdicts), onednn, default (PyTorch's, MKL).",
    )
    cpu_attention: Literal["auto", "fp32", "native"] = extension(
        "auto",
        "Precision of training attention on the CPU under bf16/fp16: auto (fp32 where, timed "
        "per machine at the run's shape and cached, it is clearly faster: at short sequences "
        "PyTorch's reduced-precision attention backward is several times slower), fp32 "
        "(always), native (the autocast dtype, as on a GPU).",
    )


@dataclass
class TrainingConfig:
    """Batch sizes, steps, seed, evaluation cadence and activation checkpointing."""

    train_batch_size: int | None = key(
        None, "Samples per optimizer step, summed over data-parallel ranks and micro-batches.", ge=1
    )
    train_micro_batch_size_per_gpu: int | None = key(
        None, "Samples per forward pass on one rank.", ge=1
    )
    gradient_accumulation_steps: int = key(1, "Micro-batches accumulated per optimizer step.", ge=1)
    batch_size: int | None = key(None, "Megatron's name for train_micro_batch_size_per_gpu.", ge=1)
    train_iters: int | None = key(None, "Optimizer steps to train for.", ge=1)
    train_epochs: int | None = key(
        None,
        "Train for this many passes over data_path's train split (instead of train_iters): "
        "(one epoch's micro-batches x epochs) // gradient_accumulation_steps steps, every "
        "epoch in the same order.",
        ge=1,
    )
    seed: int = key(1234, "Seed for initialisation, dropout and data order.", ge=0)
    exit_interval: int | None = key(
        None, "Save and exit once the step is a multiple of this.", ge=1
    )
    eval_interval: int = key(1000, "Steps between validation runs.", ge=1)
    eval_iters: int = key(100, "Batches per validation run.", ge=0)
    checkpoint_activations: bool = key(
        False, "Recompute activations in backward instead of storing them."
    )
    checkpoint_num_layers: int = key(
        1,
        "Checkpoint every this many blocks (1: all; GPT-NeoX recomputes chunks of this many).",
        ge=1,
    )
    checkpoint_activations_mode: Literal["full", "selective"] = extension(
        "full",
        "With checkpoint_activations: 'full' recomputes whole blocks; 'selective' keeps the outputs "
        "of matrix multiplies, attention and collectives and recomputes only the elementwise work.",
    )
    compile: bool = extension(
        False,
        "torch.compile the model (compile_scope says how much of it); slower to start, above "
        "all on the CPU.",
    )
    compile_scope: Literal["auto", "model", "blocks"] = extension(
        "auto",
        "With compile: 'model' compiles the whole model (embedding, blocks, final norm, head) "
        "as one graph; 'blocks' each transformer block; 'auto' the whole model where the run "
        "has no tensor, pipeline, expert or context parallelism and no ZeRO sharding, else each "
        "block.",
    )
    partition_activations: bool = no_effect(
        False,
        "Split checkpointed activations across tensor ranks.",
        "activations are not split this way; sequence_parallel shards them along the sequence",
    )
    contiguous_checkpointing: bool = no_effect(
        False, "Keep checkpointed activations in one buffer.", CKPT_SAME
    )
    checkpoint_in_cpu: bool = no_effect(
        False, "Keep checkpointed activations in CPU memory.", "activations stay on the device"
    )
    synchronize_each_layer: bool = no_effect(
        False, "CUDA-synchronise around each checkpointed block.", CKPT_SAME
    )
    profile_backward: bool = no_effect(
        False,
        "Profile checkpointed blocks in backward.",
        "use profile with profile_step_start/stop",
    )
    deepspeed_activation_checkpointing: bool = no_effect(
        True, "Use DeepSpeed's activation checkpointing.", "torch's checkpointing is always used"
    )
    skip_nonfinite_steps: int = extension(
        0,
        "Steps whose loss or gradient is NaN/Inf that may be skipped (not applied, counted in "
        "skipped_steps) before the run stops; 0: stop at the first. fp16 runs skip through the "
        "loss scaler instead.",
        ge=0,
    )
    eod_mask_loss: bool = key(False, "Leave end-of-document tokens out of the loss.")
    short_seq_prob: float = no_effect(
        0.1, "Chance of a short sample (BERT-era Megatron).", "GPT samples are always full length"
    )
    train_impl: Literal["normal", "dpo", "rm", "kto", "reinforce"] = key(
        "normal",
        "Training objective: normal (language modelling; with label datasets, SFT), dpo, kto, "
        "rm (a reward model), reinforce (online REINFORCE, RLOO, GRPO; the rollout keys).",
    )
    z_loss: float = key(
        0.0,
        "Reward models (train_impl rm): weight of the squared rewards added to the loss. For "
        "PaLM's logit z-loss on language modelling set the torchneox key lm_z_loss.",
        ge=0,
    )
    lm_z_loss: float = extension(
        0.0,
        "Weight of PaLM's logit z-loss (mean over tokens of logsumexp(logits)^2) added to the "
        "language-model loss and logged as z_loss; 0 adds nothing (GPT-NeoX has no such term).",
        ge=0,
    )
    dpo_fp32: bool = key(True, "DPO: the log-probabilities in fp32.")
    dpo_reference_free: bool = key(
        False, "DPO without a reference model (its log-probabilities taken as 0)."
    )
    dpo_beta: float = key(0.1, "DPO: beta, the strength of the preference margin.", gt=0)
    kto_fp32: bool = key(True, "KTO: the log-probabilities in fp32.")
    kto_desirable_weight: float = key(1.0, "KTO: weight of desirable (reward > 0) samples.", gt=0)
    kto_undesirable_weight: float = key(
        1.0, "KTO: weight of undesirable (reward < 0) samples.", gt=0
    )
    kto_beta: float = key(0.1, "KTO: beta.", gt=0)
    use_mup: bool = key(
        False,
        "Parametrise with muP (Microsoft's mup): width multipliers from base_shapes_file, "
        "attention 1/d, embeddings x mup_embedding_mult, logits from hidden / width_mult, "
        "MuAdam's or MuSGD's learning rate per parameter group.",
    )
    coord_check: bool = key(
        False,
        "With use_mup: a one-off run instead of training: muP's coordinate check (widths "
        "num_attention_heads x 4 .. x 256, muP and standard), its data and plots written to "
        "coord_check_up.0.* and coord_check_sp.0.* in the current folder.",
    )
    save_base_shapes: bool = key(
        False,
        "With use_mup: a one-off run instead of training: the base shapes of this model (and "
        "of its delta, hidden_size x mup_width_scale) written to base_shapes_file.",
    )
    base_shapes_file: str | None = key(
        None, "muP's base shapes (a YAML file of mup's format), written by save_base_shapes."
    )
    mup_init_scale: float = key(
        1.0, "muP: every drawn weight's initialisation multiplied by this.", gt=0
    )
    mup_attn_temp: float = key(
        1.0, "muP attention temperature: the attention scores are divided by it.", gt=0
    )
    mup_output_temp: float = key(
        1.0, "muP output temperature: the output logits are divided by it.", gt=0
    )
    mup_embedding_mult: float = key(
        1.0, "muP: the embedding layer's output multiplied by this.", gt=0
    )
    mup_rp_embedding_mult: float = key(
        1.0,
        "Learned or sinusoidal position embeddings multiplied by this (GPT-NeoX applies it with "
        "or without use_mup).",
    )
    mup_width_scale: int = key(
        2, "save_base_shapes: the delta model's width, hidden_size x this.", ge=2
    )
    char_level_ppl: bool = no_effect(
        False,
        "Also report perplexity per character.",
        "only token-level perplexity is reported so far",
    )
    curriculum_learning: dict[str, Any] | None = key(
        None,
        "DeepSpeed's sequence-length curriculum: {enabled, curriculum_type: seqlen, "
        "min_difficulty, max_difficulty, schedule_type: fixed_linear | fixed_root | "
        "fixed_discrete, schedule_config}; each training step's samples cut to its length.",
    )
    lora: dict[str, Any] | None = extension(
        None,
        "Low-rank adapters, the base frozen: {rank (8), alpha (8), dropout (0), target_modules "
        "([q_proj, v_proj]): torchneox's layer names (attention.wq/wk/wv/wo, mlp.up/gate/down) "
        "or Hugging Face's (q_proj ... down_proj), base_dtype (fp32; bf16 stores the frozen base's "
        "linear weights in bfloat16)}; each adds (alpha / rank) B(A(dropout(x))).",
    )
    curriculum_seqlen: int = derived(
        0, "The curriculum's length at the current step (logged in the metrics)."
    )
    adlr_autoresume: bool = no_effect(
        False,
        "NVIDIA ADLR cluster auto-resume.",
        "SIGTERM saves a checkpoint and rerunning the command resumes",
    )
    adlr_autoresume_interval: int = no_effect(
        1000, "Steps between ADLR auto-resume checks.", "ADLR auto-resume is not used"
    )


@dataclass
class CheckpointConfig:
    """Where and when checkpoints are saved and loaded."""

    save: str | None = key(None, "Directory checkpoints are written to.")
    load: str | None = key(
        None,
        "Directory to resume from (its 'latest' checkpoint), or a Hugging Face model folder "
        "to start from (its config.json gives the model keys; step 0, a fresh optimizer).",
    )
    save_hf: str | None = extension(
        None,
        "A Hugging Face folder written at the end of training (weights, config.json, the "
        "tokenizer), as convert to-hf writes it; a non-empty one needs train --force.",
    )
    checkpoint_factor: int | None = key(
        None, "Save every this many steps (linear), or at powers of it (log).", ge=1
    )
    checkpoint_scale: Literal["linear", "log"] = key(
        "linear", "Spacing of saves: multiples of checkpoint_factor, or its powers."
    )
    extra_save_iters: list[int] | None = key(None, "Further steps to save at.", ge=0)
    keep_last_n_checkpoints: int | None = key(None, "Delete all but the newest this many.", ge=1)
    no_save_optim: bool = key(False, "Leave the optimizer state out of checkpoints.")
    no_save_rng: bool = key(False, "Leave RNG states out of checkpoints.")
    no_load_optim: bool = key(False, "Do not restore the optimizer state.")
    no_load_rng: bool = key(False, "Do not restore RNG states.")
    finetune: bool = key(False, "Load weights only and start at step 0 with a fresh optimizer.")
    async_checkpointing: bool = extension(
        False,
        "Write checkpoints in the background (async_checkpoint_writer says what writes them): "
        "the state is copied at the save step and training goes on while it is written; "
        "'latest' moves only once every rank's files are complete.",
    )
    async_checkpoint_writer: Literal["process", "thread"] = extension(
        "process",
        "What writes a background checkpoint: 'process', a writer process per rank started "
        "with the run (the step does not share its interpreter; the state is staged in shared "
        "memory, /dev/shm), or 'thread', torch distributed checkpoint's writer thread (staged in "
        "the process's memory). Without room in /dev/shm the run says so and uses the thread.",
    )
    checkpoint_validation_with_forward_pass: bool = no_effect(
        False,
        "Store a forward pass with the checkpoint and check it on load.",
        "checkpoints carry a manifest that is checked on load instead",
    )
    s3_path: str | None = key(
        None,
        "s3://BUCKET/PREFIX: after each save rank 0 uploads the checkpoint to "
        "PREFIX/<save's basename>/global_stepN/ in the background (boto3: pip install "
        "torchneox[s3]; AWS credentials and AWS_ENDPOINT_URL from the environment).",
    )
    s3_chunk_size: int = key(
        104857600,
        "Bytes per part of the S3 multipart uploads (S3 takes parts of 5 MiB or more).",
        gt=0,
    )
    config_files: dict[str, Any] | None = derived(
        None, "The original config files, stored by GPT-NeoX with each checkpoint."
    )
