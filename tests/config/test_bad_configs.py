"""A corpus of wrong configs: each must give one clear line (file, key, what to do), exit 2,
and no traceback."""

from __future__ import annotations

import pytest

from torchneox.cli import main

BASE = """{
  "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
  "train_micro_batch_size_per_gpu": 2, "train_iters": 10,
  "optimizer": {"type": "Adam", "params": {"lr": 1.0e-3}},
}
"""

# (case id, files {name: text}, extra CLI arguments, fragments the one-line error must contain)
CASES = [
    (
        "typo",
        {"a.yml": "{hiden_size: 64}"},
        [],
        ["a.yml", "hiden_size: unknown key; did you mean hidden_size?"],
    ),
    (
        "typo-hyphen",
        {"a.yml": "{num-layer: 2}"},
        [],
        ["num_layer: unknown key; did you mean num_layers?"],
    ),
    ("unknown-no-match", {"a.yml": "{zzqqxx: 1}"}, [], ["a.yml: zzqqxx: unknown key"]),
    (
        "optimizer-type-without-its-dict",
        {"a.yml": "{optimizer_type: sm3}"},
        [],
        ["a.yml: optimizer_type: sm3 would not run", "write optimizer: {type: sm3"],
    ),
    (
        "optimizer-type-against-its-dict",
        {"a.yml": "{optimizer_type: lion}"},
        [],
        ["a.yml: optimizer_type: lion would not run: the optimizer dict gives the optimizer (adam"],
    ),
    (
        "quoted-whole-number",
        {"a.yml": '{hidden_size: "64"}'},
        [],
        ["a.yml: hidden_size: expected an integer, got '64' (a string: write 64 without quotes)"],
    ),
    (
        "fp8-margin",
        {"a.yml": "{te_fp8_mha: true, te_fp8_margin: 2}"},
        [],
        ["te_fp8_margin: torchao's fp8 scales have no margin; set te_fp8_margin 0"],
    ),
    (
        "bf16-gather-without-bf16",
        {"a.yml": "{precision: fp16, zero_param_dtype: bf16}"},
        [],
        ["a.yml", "zero_param_dtype: bf16 weights are for precision: bfloat16"],
    ),
    (
        "int-as-word",
        {"a.yml": "{num_layers: twelve}"},
        [],
        ["a.yml: num_layers: expected an integer, got 'twelve'"],
    ),
    (
        "int-as-fraction",
        {"a.yml": "{num_layers: 2.5}"},
        [],
        ["num_layers: expected an integer, got 2.5"],
    ),
    (
        "bool-as-int",
        {"a.yml": "{no_weight_tying: 1}"},
        [],
        ["no_weight_tying: expected true or false, got 1"],
    ),
    ("float-as-word", {"a.yml": "{min_lr: small}"}, [], ["min_lr: expected a number, got 'small'"]),
    (
        "list-as-int",
        {"a.yml": "{extra_save_iters: 5}"},
        [],
        ["extra_save_iters: expected a list of integers"],
    ),
    (
        "choice-typo",
        {"a.yml": "{norm: layernrom}"},
        [],
        ["norm: 'layernrom' is not one of", "did you mean layernorm?"],
    ),
    (
        "choice-unknown",
        {"a.yml": "{pos_emb: wavelets}"},
        [],
        ["pos_emb: 'wavelets' is not one of learned, rotary"],
    ),
    ("activation-typo", {"a.yml": "{activation: swigl}"}, [], ["did you mean swiglu?"]),
    (
        "decay-style",
        {"a.yml": "{lr_decay_style: cosin}"},
        [],
        ["lr_decay_style: 'cosin'", "did you mean cosine?"],
    ),
    (
        "precision",
        {"a.yml": "{precision: bf16}"},
        [],
        ["precision: 'bf16' is not one of fp16, fp32, bfloat16"],
    ),
    (
        "heads-not-dividing",
        {"a.yml": "{hidden_size: 100, num_attention_heads: 12}"},
        [],
        ["hidden_size 100 is not divisible by num_attention_heads 12"],
    ),
    (
        "kv-heads",
        {"a.yml": "{hidden_size: 64, num_attention_heads: 8, num_kv_heads: 3}"},
        [],
        ["num_kv_heads", "not a multiple of num_kv_heads 3"],
    ),
    (
        "batch-inconsistent",
        {
            "a.yml": "{train_batch_size: 32, train_micro_batch_size_per_gpu: 4, gradient_accumulation_steps: 2}"
        },
        ["--world-size", "2"],
        [
            "train_batch_size: 32 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x data-parallel size 2 = 16"
        ],
    ),
    (
        "batch-not-divisible",
        {"a.yml": "{train_batch_size: 30, train_micro_batch_size_per_gpu: 4}"},
        [],
        ["30 is not divisible by train_micro_batch_size_per_gpu 4"],
    ),
    (
        "world-not-divisible",
        {"a.yml": "{model_parallel_size: 2, pipe_parallel_size: 2}"},
        ["--world-size", "6"],
        ["world size 6 is not divisible by pipeline stages 2 x model_parallel_size 2 = 4"],
    ),
    (
        "mp-not-dividing-heads",
        {"a.yml": "{hidden_size: 64, num_attention_heads: 4, model_parallel_size: 3}"},
        [],
        ["model_parallel_size: 3 does not divide num_attention_heads 4"],
    ),
    (
        "more-stages-than-layers",
        {"a.yml": "{num_layers: 2, pipe_parallel_size: 4}"},
        [],
        ["4 stages but only 2 layers"],
    ),
    (
        "1f1b-fewer-micro-batches-than-stages",
        {
            "a.yml": "{num_layers: 4, pipe_parallel_size: 4, pipeline_schedule: 1f1b, "
            "train_micro_batch_size_per_gpu: 2}"
        },
        ["--world-size", "4"],
        ["gradient_accumulation_steps: 1 micro-batches per step, but pipeline_schedule 1f1b needs"],
    ),
    (
        "interleaved-micro-batches-not-multiple",
        {
            "a.yml": "{num_layers: 4, pipe_parallel_size: 2, pipeline_schedule: interleaved_1f1b, "
            "train_micro_batch_size_per_gpu: 2, gradient_accumulation_steps: 3}"
        },
        ["--world-size", "2"],
        ["schedule interleaved_1f1b needs a multiple of pipe_parallel_size (2)"],
    ),
    (
        "key-in-two-files",
        {"a.yml": "{seed: 1}", "b.yml": "{seed: 2}"},
        [],
        ["seed: given in both", "a.yml and", "b.yml"],
    ),
    (
        "hyphen-and-underscore",
        {"a.yml": "{seq-length: 8, seq_length: 8}"},
        [],
        ["a.yml: seq_length: given twice in this file"],
    ),
    (
        "yaml-syntax",
        {"a.yml": "{num_layers: 2,, \n hidden_size: [1, 2}"},
        [],
        ["a.yml:", "YAML syntax error"],
    ),
    (
        "yaml-duplicate",
        {"a.yml": "num_layers: 2\nnum_layers: 3\n"},
        [],
        ["a.yml:2:1: YAML syntax error: key 'num_layers' appears twice"],
    ),
    (
        "not-a-mapping",
        {"a.yml": "- 1\n- 2\n"},
        [],
        ["a.yml: a config file must be a mapping of keys to values, not a list"],
    ),
    ("missing-file", {}, ["nowhere.yml"], ["nowhere.yml: no such config file"]),
    (
        "optimizer-type",
        {"a.yml": "{optimizer: {type: Adamm, params: {lr: 0.1}}}"},
        [],
        ["optimizer: unknown type 'Adamm'; did you mean adam?"],
    ),
    (
        "optimizer-refused",
        {"a.yml": "{optimizer: {type: OneBitAdam, params: {lr: 0.1}}}"},
        [],
        [
            "1-bit Adam",
            "is not supported; use Adam, AdamW, SGD, Lion, SM3, madgrad_wd, LAMB or muon",
        ],
    ),
    (
        "sm3-momentum",
        {"a.yml": "{optimizer: {type: sm3, params: {lr: 0.1, momentum: 1.0}}}"},
        [],
        ["optimizer: params.momentum must be in [0, 1), got 1.0"],
    ),
    (
        "sm3-weight-decay",
        {"a.yml": "{optimizer: {type: sm3, params: {lr: 0.1, weight_decay: 0.1}}}"},
        [],
        ["params.weight_decay is not a parameter of sm3"],
    ),
    (
        "lamb-amsgrad",
        {"a.yml": "{optimizer: {type: lamb, params: {lr: 0.1, amsgrad: true}}}"},
        [],
        ["params.amsgrad: true is not a LAMB variant"],
    ),
    (
        "lamb-coeffs",
        {"a.yml": "{optimizer: {type: lamb, params: {lr: 0.1, min_coeff: 2, max_coeff: 1}}}"},
        [],
        ["params.min_coeff 2.0 is above params.max_coeff 1.0"],
    ),
    (
        "optimizer-param",
        {"a.yml": "{optimizer: {type: Adam, params: {lr: 0.1, beta: [0.9, 0.9]}}}"},
        [],
        ["params.beta is not a parameter of Adam; did you mean betas?"],
    ),
    (
        "adam-without-bias-correction",
        {"a.yml": "{optimizer: {type: Adam, params: {lr: 0.1, bias_correction: false}}}"},
        [],
        ["optimizer: params.bias_correction: false (Adam without bias correction) is not built"],
    ),
    (
        "empty-file",
        {"a.yml": "# nothing but a comment\n"},
        [],
        ["a.yml: the config file is empty (no keys)"],
    ),
    (
        "mamba-d-inner-twice",
        {
            "a.yml": "{hidden_size: 64, num_attention_heads: 12, num_layers: 2, seq_length: 64, "
            "attention_config: [[[mamba], all]], intermediate_size: 128, expansion_factor: 2}"
        },
        [],
        ["a.yml: expansion_factor: cannot be set with intermediate_size for mamba layers"],
    ),
    (
        "reinforce",
        {"a.yml": "{train_impl: reinforce, serve_model_weights: true}"},
        [],
        ["a.yml: train_impl: reinforce trains on rollouts: set rollout_prompts"],
    ),
    (
        "reinforce-without-rewards",
        {"a.yml": "{train_impl: reinforce, rollout_prompts: p.jsonl}"},
        [],
        ["a.yml: rollout_prompts: rollouts sampled in the run need one source of rewards"],
    ),
    (
        "reinforce-two-baselines",
        {
            "a.yml": "{train_impl: reinforce, dataset_impl: online, reinforce_leave_one_out: true, "
            "advantage_normalization: group}"
        },
        [],
        ["a.yml: advantage_normalization: group (GRPO) and reinforce_leave_one_out (RLOO)"],
    ),
    (
        "reinforce-one-generation-rloo",
        {
            "a.yml": "{train_impl: reinforce, rollout_prompts: p.jsonl, reward_function: 'r:f', "
            "rollout_generations: 1, reinforce_leave_one_out: true}"
        },
        [],
        ["a.yml: rollout_generations: reinforce_leave_one_out compares the completions"],
    ),
    (
        "reinforce-groups-split-over-steps",
        {
            "a.yml": "{train_impl: reinforce, rollout_prompts: p.jsonl, reward_function: 'r:f', "
            "train_micro_batch_size_per_gpu: 6, rollout_generations: 4}"
        },
        [],
        [
            "a.yml: rollout_generations: each rank's samples per step (micro-batch 6 x 1 "
            "accumulation steps) hold whole prompts' groups of 4 completions"
        ],
    ),
    (
        "reinforce-full-kl-through-a-pipeline",
        {
            "a.yml": "{train_impl: reinforce, dataset_impl: online, pipe_parallel_size: 2, "
            "kl_impl: full}"
        },
        [],
        ["a.yml: kl_impl: full reads the reference's whole distributions"],
    ),
    (
        "online-data-without-reinforce",
        {"a.yml": "{dataset_impl: online}"},
        [],
        ["a.yml: dataset_impl: online datasets hold REINFORCE's rollouts"],
    ),
    (
        "fp8-delayed-scaling",
        {"a.yml": "{te_fp8_mha: true, te_fp8_amax_compute_algo: max}"},
        [],
        ["a.yml", "te_fp8_amax_compute_algo: torchao scales fp8 from each tensor's current amax"],
    ),
    (
        "tanh-and-onnx-gelu",
        {"a.yml": "{bias_gelu_fusion: true, onnx_safe: true}"},
        [],
        ["bias_gelu_fusion: cannot be set together with onnx_safe"],
    ),
    (
        "rope-scaling-not-built",
        {"a.yml": "{rope_scaling: {type: longrope, factor: 4}}"},
        [],
        [
            "rope_scaling: type 'longrope' is not built; torchneox scales rotary frequencies as "
            "linear or llama3 or dynamic or yarn"
        ],
    ),
    (
        "rope-scaling-dynamic-without-context",
        {"a.yml": "{rope_scaling: {type: dynamic, factor: 2}}"},
        [],
        ["rope_scaling: dynamic scaling needs original_max_position_embeddings > 0, got None"],
    ),
    (
        "rope-scaling-yarn-truncate",
        {
            "a.yml": "{rope_scaling: {type: yarn, factor: 4, original_max_position_embeddings: "
            "64, truncate: 1}}"
        },
        [],
        ["rope_scaling: yarn's truncate is true or false, got 1"],
    ),
    (
        "qk-norm-neox-with-gqa",
        {
            "a.yml": "{hidden_size: 64, num_attention_heads: 4, num_kv_heads: 2, use_qk_layernorm: true}"
        },
        [],
        ["qk_norm_scope: neox", "cannot take 4 query heads and 2 key heads", "head or width"],
    ),
    (
        "norm-output-with-parallel-residual",
        {"a.yml": "{norm_position: output, gpt_j_residual: true}"},
        [],
        ["norm_position: 'output' (OLMo 2's post-norm) is built for the sequential residual"],
    ),
    (
        "rope-scaling-missing-field",
        {"a.yml": "{rope_scaling: {type: llama3, factor: 8}}"},
        [],
        ["rope_scaling: llama3 scaling needs low_freq_factor > 0, got None"],
    ),
    (
        "optimizer-betas",
        {"a.yml": "{optimizer: {type: Adam, params: {lr: 0.1, betas: [0.9]}}}"},
        [],
        ["params.betas must be two numbers"],
    ),
    (
        "lr-conflict",
        {"a.yml": "{lr: 0.1, optimizer: {type: Adam, params: {lr: 0.2}}}"},
        [],
        ["lr: 0.1 contradicts optimizer.params.lr 0.2"],
    ),
    (
        "zero-stage",
        {"a.yml": "{zero_optimization: {stage: 4}}"},
        [],
        ["zero_optimization: stage must be 0, 1, 2 or 3, got 4"],
    ),
    (
        "zero-offload-nvme",
        {"a.yml": "{zero_optimization: {stage: 3, offload_param: {device: nvme}}}"},
        [],
        ["a.yml: zero_optimization: offload_param.device nvme", "DeepSpeed-only", "device: cpu"],
    ),
    (
        "zero-offload-stage-0",
        {"a.yml": "{zero_optimization: {stage: 0, cpu_offload: true}}"},
        [],
        ["zero_optimization: cpu_offload offloads from ZeRO's", "stage to 1, 2 or 3"],
    ),
    (
        "zero-offload-param-stage-2",
        {"a.yml": "{zero_optimization: {stage: 2, offload_param: {device: cpu}}}"},
        [],
        ["offload_param needs zero_optimization.stage 3", "use offload_optimizer"],
    ),
    (
        "zero-offload-ratio",
        {"a.yml": "{zero_optimization: {stage: 3, offload_optimizer: {device: cpu, ratio: 0.5}}}"},
        [],
        ["offload_optimizer.ratio 0.5 (partial offload) is not built", "remove ratio"],
    ),
    (
        "zero-offload-unknown-entry",
        {"a.yml": "{zero_optimization: {stage: 3, offload_optimizer: {device: cpu, pin: true}}}"},
        [],
        ["offload_optimizer: unknown entry 'pin'"],
    ),
    (
        "cpu-adam-stage-0",
        {"a.yml": "{optimizer: {type: cpu_adam, params: {lr: 0.001}}}"},
        [],
        ["a.yml: optimizer: optimizer.type cpu_adam offloads from ZeRO's", "1, 2 or 3"],
    ),
    (
        "cpu-adam-amsgrad",
        {"a.yml": "{optimizer: {type: cpu_adam, params: {lr: 0.001, amsgrad: true}}}"},
        [],
        ["params.amsgrad: true is not supported by DeepSpeed's CPU Adam"],
    ),
    (
        "fp16-and-bf16",
        {"a.yml": "{fp16: {enabled: true}, bf16: {enabled: true}}"},
        [],
        ["both fp16 and bf16 are enabled"],
    ),
    (
        "precision-conflict",
        {"a.yml": "{precision: fp32, fp16: {enabled: true}}"},
        [],
        ["precision: 'fp32' contradicts fp16.enabled: true"],
    ),
    ("warmup-range", {"a.yml": "{warmup: 1.5}"}, [], ["warmup: must be in [0, 1], got 1.5"]),
    ("negative-iters", {"a.yml": "{train_iters: -5}"}, [], ["train_iters: must be >= 1, got -5"]),
    (
        "dropout-range",
        {"a.yml": "{hidden_dropout: 1.0}"},
        [],
        ["hidden_dropout: must be in [0, 1), got 1.0"],
    ),
    ("split", {"a.yml": "{split: '90,x,5'}"}, [], ["split: '90,x,5'", "like '949,50,1'"]),
    (
        "weights-mismatch",
        {"a.yml": "{train_data_paths: [a, b], train_data_weights: [1.0]}"},
        [],
        ["train_data_weights: has 1 weights for 2 train_data_paths"],
    ),
    (
        "mamba-inner-fusion-with-biases",
        {
            "a.yml": "{hidden_size: 64, num_attention_heads: 4, num_layers: 2, seq_length: 64, "
            "attention_config: [[[mamba], 2]], mamba_inner_func_fusion: true, "
            "mamba_use_bias_in_linears: true}"
        },
        [],
        ["a.yml: mamba_inner_func_fusion: cannot be set with mamba_use_bias_in_linears"],
    ),
    (
        "attention-count",
        {"a.yml": "{num_layers: 4, attention_config: [[[global], 3]]}"},
        [],
        ["attention_config: describes 3 layers but num_layers is 4"],
    ),
    # found by the fuzzer: per-layer lists were built before anything bounded the count
    (
        "layers-beyond-reason",
        {"a.yml": "{num_layers: 304553684}"},
        [],
        ["num_layers: 304,553,684 layers is more than 100,000; is it a typo?"],
    ),
    (
        "attention-count-beyond-layers",
        {"a.yml": "{attention_config: [[[global], 1099511627776]]}"},
        [],
        ["attention_config: describes more than 100,000 layers (num_layers is unset)"],
    ),
    (
        "attention-count-over",
        {"a.yml": "{num_layers: 4, attention_config: [[[global], 2], [[flash], 3]]}"},
        [],
        ["attention_config: describes more than 4 layers but num_layers is 4"],
    ),
    (
        "attention-pattern-repeated",  # GPT-NeoX repeats the pattern: 2 x 4 = 8 layers
        {"a.yml": "{num_layers: 4, attention_config: [[[rwkv, global], 4]]}"},
        [],
        ["attention_config: describes more than 4 layers but num_layers is 4 (each entry's"],
    ),
    (
        "attention-all-and-more",
        {"a.yml": "{num_layers: 4, attention_config: [[[global], 2], [[rwkv, global], all]]}"},
        [],
        ["attention_config: an entry with 'all' describes every layer; remove the other"],
    ),
    (
        "mup-without-base-shapes",
        {"a.yml": "{use_mup: true}"},
        [],
        ["a.yml: base_shapes_file: use_mup needs base_shapes_file (write it once with"],
    ),
    (
        "mup-base-shapes-missing",
        {"a.yml": "{use_mup: true, base_shapes_file: nowhere.yml}"},
        [],
        ["nowhere.yml: base_shapes_file: does not exist: write it with save_base_shapes: true"],
    ),
    (
        "mup-lion",
        {"a.yml": "{use_mup: true, base_shapes_file: b.yml, optimizer: {type: Lion}}"},
        [],
        ["optimizer.type: use_mup takes optimizer type Adam or SGD (mup's MuAdam and MuSGD"],
    ),
    (
        "rpe-max-distance-inside-the-exact-buckets",
        {"a.yml": "{pos_emb: rpe, rpe_num_buckets: 32, rpe_max_distance: 16}"},
        [],
        ["a.yml: rpe_max_distance: 16 must exceed rpe_num_buckets / 2 = 16"],
    ),
    (
        "dpo-without-pairs",
        {"a.yml": "{train_impl: dpo}"},
        [],
        ["train_impl: 'dpo' trains on chosen and rejected pairs: set dataset_impl: pairwise"],
    ),
    (
        "pairs-packed",
        {"a.yml": "{train_impl: rm, dataset_impl: pairwise}"},
        [],
        ["pack_impl: pairwise data is not packed (as in GPT-NeoX)"],
    ),
    (
        "kto-odd-micro-batch",
        {
            "a.yml": "{train_impl: kto, pack_impl: unpacked, train_micro_batch_size_per_gpu: 3, "
            "train_data_paths: [t], train_reward_data_paths: [r]}"
        },
        [],
        ["train_micro_batch_size_per_gpu: kto pairs the two halves of each micro-batch"],
    ),
    (
        "kto-without-rewards",
        {"a.yml": "{train_impl: kto, pack_impl: unpacked}"},
        [],
        ["train_reward_data_paths: kto needs each document's reward"],
    ),
    (
        "unpacked-from-one-data-path",
        {"a.yml": "{pack_impl: unpacked, data_path: d}"},
        [],
        ["pack_impl: 'unpacked' samples whole datasets: give train_data_paths"],
    ),
    (
        "rotary-odd",
        {"a.yml": "{hidden_size: 64, num_attention_heads: 4, pos_emb: rotary, rotary_pct: 0.2}"},
        [],
        ["rotary_pct: rotates 3 of 16 head dimensions", "rotary needs an even"],
    ),
    (
        "moe-top-k",
        {"a.yml": "{moe_num_experts: 4, moe_top_k: 5}"},
        [],
        ["moe_top_k: 5 is more than moe_num_experts 4"],
    ),
    (
        "set-not-key-value",
        {"a.yml": BASE},
        ["--set", "train_iters"],
        ["--set: 'train_iters' is not KEY=VALUE"],
    ),
    (
        "set-unknown",
        {"a.yml": BASE},
        ["--set", "train_iter=5"],
        ["--set: train_iter: unknown key; did you mean train_iters?"],
    ),
    (
        "set-wrong-type",
        {"a.yml": BASE},
        ["--set", "seq_length=long"],
        ["--set: seq_length: expected an integer, got 'long'"],
    ),
    (
        "set-into-scalar",
        {"a.yml": BASE},
        ["--set", "seed.x=1"],
        ["--set: cannot set seed.x: seed is not a mapping"],
    ),
    (
        "max-pos-short",
        {"a.yml": "{seq_length: 64, max_position_embeddings: 32}"},
        [],
        ["max_position_embeddings: 32 is shorter than seq_length 64"],
    ),
    (
        "min-lr-above-peak",
        {"a.yml": "{min_lr: 0.5, optimizer: {type: Adam, params: {lr: 0.1}}}"},
        [],
        ["min_lr: 0.5 is above the peak learning rate 0.1"],
    ),
    (
        "gpt-j-tied-alone",
        {"a.yml": "{gpt_j_tied: true}"},
        [],
        ["gpt_j_tied: only means something with gpt_j_residual: true"],
    ),
    (
        "rwkv-hidden-size",
        {"a.yml": BASE.replace("64", "48").replace("}\n", 'attention_config: [[["rwkv"], 2]]}\n')},
        [],
        ["a.yml", "hidden_size: 48 is not a multiple of 32, as RWKV layers need"],
    ),
    (
        "rwkv-dim-att",
        {"a.yml": BASE.replace("}\n", 'attention_config: [[["rwkv"], 2]], dim_att: 80}\n')},
        [],
        ["dim_att: RWKV's dim_att 80 must be a multiple of 32 and of num_attention_heads 4"],
    ),
    (
        "rwkv-two-widths",
        {
            "a.yml": BASE.replace(
                "}\n",
                'attention_config: [[["rwkv"], 2]], intermediate_size: 128, expansion_factor: 2}\n',
            )
        },
        [],
        ["expansion_factor: RWKV layers take intermediate_size or expansion_factor, not both"],
    ),
    (
        "replica-groups-without-a-lighthouse",
        {"a.yml": "{ft_replica_groups: 2}"},
        [],
        ["a.yml", "ft_replica_groups: replica groups agree through a torchft lighthouse"],
    ),
    (
        "replica-group-out-of-range",
        {"a.yml": "{ft_lighthouse: 'http://h:1', ft_replica_groups: 2, ft_replica_group: 2}"},
        [],
        ["ft_replica_group: is 2, but the groups are numbered 0 to 1"],
    ),
    (
        "more-min-replicas-than-groups",
        {"a.yml": "{ft_lighthouse: 'http://h:1', ft_replica_groups: 2, ft_min_replicas: 3}"},
        [],
        ["ft_min_replicas: is 3, more than the 2 replica groups (ft_replica_groups)"],
    ),
    (
        "diloco-outer-key-without-diloco",
        {"a.yml": "{ft_lighthouse: 'http://h:1', ft_diloco_outer_lr: 0.5}"},
        [],
        ["ft_diloco_outer_lr: only means something with DiLoCo: set ft_diloco_sync_every"],
    ),
    (
        "diloco-without-a-lighthouse",
        {"a.yml": "{ft_diloco_sync_every: 10}"},
        [],
        ["ft_diloco_sync_every: replica groups agree through a torchft lighthouse"],
    ),
    (
        "diloco-nesterov-without-momentum",
        {
            "a.yml": "{ft_lighthouse: 'http://h:1', ft_diloco_sync_every: 4, "
            "ft_diloco_outer_momentum: 0}"
        },
        [],
        ["ft_diloco_outer_nesterov: Nesterov momentum needs ft_diloco_outer_momentum above 0"],
    ),
    (
        "world-size-flag",
        {"a.yml": BASE},
        ["--world-size", "0"],
        ["--world-size: must be >= 1, got 0"],
    ),
]


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 30


@pytest.mark.parametrize(
    ("files", "extra", "fragments"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_config_gives_one_clear_line(tmp_path, capsys, monkeypatch, files, extra, fragments):
    monkeypatch.chdir(tmp_path)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    paths = list(files) if not extra or extra[0].startswith("--") else []
    status = main(["config", "explain", *paths, *extra])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""
    err = captured.err
    assert err.startswith("torchneox: error: ")
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"
