"""Which inherited `TrainingArguments` fields `MerakTrainer` honours, and why the others are
refused.

`MerakArguments` checks every HF field against this table: a field in `HONOURED` works with its
HF meaning; any other field must keep its HF default, and setting it raises
`NotSupportedYetError` with the reason from `REFUSED` (docs/arguments.md lists the same reasons).
"""

from __future__ import annotations

# inherited HF fields MerakTrainer honours; any other HF field must keep its HF default
HONOURED = frozenset({
    "output_dir", "per_device_train_batch_size", "per_device_eval_batch_size",
    "gradient_accumulation_steps", "num_train_epochs", "max_steps", "learning_rate",
    "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "optim", "optim_args",
    "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
    "logging_strategy", "logging_steps", "logging_first_step", "logging_nan_inf_filter",
    "log_level", "log_level_replica", "log_on_each_node", "disable_tqdm", "report_to",
    "run_name", "project", "seed", "data_seed", "use_cpu", "dataloader_drop_last",
    "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
    "dataloader_prefetch_factor", "dataloader_multiprocessing_context",
    "remove_unused_columns", "label_names",
    "train_sampling_strategy", "do_train", "do_eval", "do_predict", "local_rank",
    "ddp_timeout", "ddp_backend", "skip_memory_metrics", "save_strategy", "save_steps",
    "save_total_limit", "save_only_model", "resume_from_checkpoint",
    "average_tokens_across_devices", "eval_strategy", "prediction_loss_only", "debug",
    "use_cache", "bf16", "fp16",
    # evaluation, checkpoint choice and the loss during train() (merak.trainer.flow)
    "eval_steps", "eval_delay", "eval_on_start", "load_best_model_at_end",
    "metric_for_best_model", "greater_is_better", "label_smoothing_factor",
    "include_num_input_tokens_seen", "torch_empty_cache_steps",
    # applied by TrainingArguments / Trainer themselves: tf32 by __post_init__ (enable_tf32),
    # full_determinism by Trainer.__init__ and MerakTrainer.train (enable_full_determinism)
    "tf32", "full_determinism",
    # evaluation gathers each step's logits once, from the last pipeline stage, onto the CPU
    # (not on the accelerator as HF's loop does), so there is nothing to offload early: the
    # field is accepted and changes nothing
    "eval_accumulation_steps",
    # Merak's recomputation (activation_checkpointing): see _check_gradient_checkpointing
    "gradient_checkpointing", "gradient_checkpointing_kwargs",
    # resuming: the dp all-reduce buckets; no skipping of the resumed epoch's seen batches
    "ignore_data_skip", "ddp_bucket_cap_mb",
    # DDP hints with nothing to do: Merak does not wrap stages in DDP, and its dp reducer
    # already counts a parameter no micro-batch reached as a zero gradient (what
    # find_unused_parameters=True buys under DDP) and needs no static-graph promise
    "ddp_find_unused_parameters", "ddp_static_graph",
    # HF's own push code (init_hf_repo, push_to_hub, _push_from_checkpoint) on the HF model
    # directory gathered from the shards (merak.trainer.checkpointing)
    "push_to_hub", "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo",
    "hub_always_push", "hub_revision",
    # evaluation's compute_metrics inputs (merak.trainer.evaluation)
    "batch_eval_metrics", "eval_do_concat_batches", "include_for_metrics",
    # MerakTrainer._find_micro_batch_size (merak.runtime.memory_probe)
    "auto_find_batch_size",
    # read by transformers' own Trackio callback (report_to="trackio")
    "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id",
    # torch.compile of each stage's blocks, in place (merak.engine.compile); NEFTune noise on
    # the first stage's input embedding, shared by the TP ranks of a group (merak.trainer.neftune)
    "torch_compile", "torch_compile_backend", "torch_compile_mode", "neftune_noise_alpha",
})

# torch.utils.checkpoint keywords (HF's gradient_checkpointing_kwargs) and what Merak makes of
# them: its recomputation re-runs each block's forward itself from the kept block input, right
# before that block's backward (no torch.utils.checkpoint, no reentrant autograd), always
# replaying the RNG state of the first forward (dropout masks equal)
CHECKPOINT_KWARGS = {
    "use_reentrant": "irrelevant: no torch.utils.checkpoint is involved",
    "preserve_rng_state": "the RNG state is always replayed (True); False would only skip "
                          "that for speed, so it is accepted and the replay kept",
    "determinism_check": "irrelevant: the replayed forward is the same program",
    "debug": "irrelevant: no torch.utils.checkpoint is involved",
}


_NO_ACCELERATE = ("MerakTrainer drives data, tensor and pipeline parallelism itself (merak.init, "
                  "the pipeline interpreter); accelerate's Accelerator does not wrap the model")
_ZERO = ("ZeRO is MerakArguments.zero_stage: 1 shards optimizer state, 2 and 3 shard gradients "
         "and parameters through PyTorch FSDP2 over the dp ranks of every pipeline stage")

# inherited fields that cannot apply (yet): the reason, shown when one is set
REFUSED = {
    "accelerator_config": _NO_ACCELERATE,
    "parallelism_config": _NO_ACCELERATE + "; give the degrees to merak.init(dp=, tp=, pp=)",
    "deepspeed": _ZERO,
    "fsdp": _ZERO,
    "fsdp_config": _ZERO,
    "activation_checkpointing_kwargs": (
        "HF's activation_checkpointing_enable() is not called (the pipeline split traces the "
        "plain forward and the runtime recomputes blocks); choose what is recomputed with "
        "activation_checkpoint_ratio, activation_memory_budget or checkpoint_num_layers"),
    "ddp_broadcast_buffers": (
        "there is no DDP wrapper to broadcast buffers from rank 0 each step; every rank "
        "builds its buffers from the same seed"),
    "bf16_full_eval": "evaluation runs the training weights under the bf16/fp16 autocast of "
                      "bf16=True / fp16=True; casting every stage's weights is not supported yet",
    "fp16_full_eval": "evaluation runs the training weights under the bf16/fp16 autocast of "
                      "bf16=True / fp16=True; casting every stage's weights is not supported yet",
    "eval_use_gather_object": "the last pipeline stage's predictions are gathered as tensors",
    "length_column_name": "only used with group_by_length sampling, which MerakTrainer does "
                          "not have (train_sampling_strategy 'random' or 'sequential')",
    "dataloader_in_order": "batches are read in order on every rank (the pipeline and the dp "
                           "shards depend on it)",
    "optim_target_modules": "GaLore/APOLLO-style optimizers over chosen modules are not "
                            "supported with pipeline stages yet",
    "use_liger_kernel": "Liger patches the modeling code with Triton (CUDA) kernels, which the "
                        "pipeline split does not trace yet",
    "liger_kernel_config": "Liger patches the modeling code with Triton (CUDA) kernels, which "
                           "the pipeline split does not trace yet",
    "restore_callback_states_from_checkpoint": "Merak checkpoints do not keep callback states "
                                               "yet",
    "enable_jit_checkpoint": "saving on SIGTERM is not supported yet; use save_steps",
    "save_on_each_node": "a checkpoint's shared files and save_model's HF directory are "
                         "written by global rank 0 into the output_dir every rank writes its "
                         "shard into, so all nodes must share that directory",
}
