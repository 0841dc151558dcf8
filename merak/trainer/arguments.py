"""`MerakArguments`: transformers' `TrainingArguments` plus Merak's fields, validated at once.

Every field either works or raises. Merak fields whose feature has not landed raise
`NotSupportedYetError` when set to anything but their default; every inherited HF field that
`MerakTrainer` does not honour is checked the same way against its HF default (`hf_fields.HONOURED`
lists the ones it does). Bad values raise `ValueError` naming the field and the allowed values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from merak import rules
from merak.engine.compile import check_compile_mode
from merak.engine.options import EngineOptions
from merak.partition.options import SPLIT_METHODS, TRACE_METHODS
from merak.rules import NotSupportedYetError  # noqa: F401 - MerakArguments' error, re-exported
from merak.schedule.registry import SCHEDULES
from merak.stages import assign
from merak.tensor_parallel.plans.tp_plan import LAYER_LIST_KEYS, TPPlan
from merak.trainer.argument_checks import ArgumentChecks
from merak.trainer.argument_ranges import check_ranges
from merak.trainer.config_bases import keep_declared_defaults
from merak.trainer.engine_options import engine_options_of
from merak.trainer.job import JobView


def _help(group: str, text: str) -> dict[str, str]:
    """A Merak field's metadata: its help text, tagged with its group for `--help` (HF's parser
    puts all of a dataclass's fields in one argument group)."""
    return {"help": f"[Merak {group}] {text}"}


@dataclass
class MerakArguments(ArgumentChecks, JobView, TrainingArguments):
    """`TrainingArguments` with Merak's pipeline, tensor-parallel and runtime fields.

    Degrees come from `merak.init(dp=, tp=, pp=)`; micro-batches per step are
    `gradient_accumulation_steps` and a micro-batch is `per_device_train_batch_size` rows.
    """

    # ---- automatic strategy (merak.strategy)
    auto_parallel: bool = field(default=False, metadata=_help("auto",
        "plan dp x tp x pp (and ep for a mixture of experts; merak.init(ep=N) keeps it at N), "
        "micro-batching, schedule, recomputation and ZeRO at train() (measured, predicted, "
        "dry-run; merak.init() without degrees); the optimizer step's "
        "global batch is per_device_train_batch_size x gradient_accumulation_steps"))
    plan: str | None = field(default=None, metadata=_help("auto",
        "a `merak plan` file (plan.json) to train with: its layout, micro-batching, schedule, "
        "recomputation and ZeRO stage (merak.init(plan=...) for the degrees)"))
    plan_memory_gib: float | None = field(default=None, metadata=_help("auto",
        "auto_parallel: the per-rank memory limit (default: the device's)"))
    plan_dry_runs: int = field(default=3, metadata=_help("auto",
        "auto_parallel: best predicted candidates measured with a few real steps"))

    # ---- pipeline schedule and partitioning
    train_schedule: str = field(default="1f1b", metadata=_help("pipeline",
        f"pipeline schedule: {sorted(SCHEDULES)}"))
    num_model_chunks: int = field(default=2, metadata=_help("pipeline",
        "model chunks per pipeline rank for train_schedule='interleaved_1f1b' (the model "
        "is split into pp x this many virtual stages; zbv and dualpipev always place 2 per "
        "rank, in a V)"))
    partition_method: str = field(default="uniform", metadata=_help("pipeline",
        f"stage assignment: {list(assign.PARTITION_METHODS)}"))
    split_method: str = field(default="farthest_min_deps", metadata=_help("pipeline",
        f"where non-block ops go: {list(SPLIT_METHODS)}"))
    custom_split_points: list[str] | None = field(default=None, metadata=_help("pipeline",
        "module names where a stage begins (split_method='layer_split')"))
    custom_partition: list[int] | None = field(default=None, metadata=_help("pipeline",
        "block indices where stages begin (partition_method='custom')"))
    trace_method: str = field(default="export", metadata=_help("pipeline",
        f"graph capture front-end: {list(TRACE_METHODS)}"))
    input_names: list[str] | None = field(default=None, metadata=_help("pipeline",
        "model inputs to trace and feed (default: every key of a batch)"))
    no_tie_modules: bool = field(default=False, metadata=_help("pipeline",
        "do not sum gradients of weights shared across stages"))
    # ---- recomputation
    activation_checkpointing: bool = field(default=False, metadata=_help("recomputation",
        "recompute the activations of blocks before their backward (every block of "
        "every stage unless activation_checkpoint_ratio or activation_memory_budget "
        "says otherwise)"))
    checkpoint_num_layers: int = field(default=1, metadata=_help("recomputation",
        "consecutive blocks per recomputed chunk (only its input is kept)"))
    recompute_in_backward: bool = field(default=False, metadata=_help("recomputation",
        "rerun each recomputed block inside the backward, one at a time (as "
        "torch.utils.checkpoint), instead of a stage's blocks all at once before it: "
        "less memory, no schedulable recomputation; needs checkpoint_num_layers=1"))
    activation_checkpoint_ratio: list[float] | None = field(
        default=None, metadata=_help("recomputation",
        "fraction of each stage's blocks recomputed: one value per stage, or one value "
        "for the first stage, later stages then recomputing the least that keeps their "
        "peak activation memory at or below the first's (stage-aware)"))
    activation_memory_budget: list[float] | None = field(
        default=None, metadata=_help("recomputation",
        "MiB of activations per stage (one value for all, or one per stage): each "
        "stage recomputes the fewest blocks whose predicted peak fits (measured "
        "per-block bytes replayed through the schedule)"))
    # ---- runtime
    wall_clock_breakdown: bool = field(default=False, metadata=_help("runtime",
        "log the time of each instruction kind per step"))
    dealloc_pipeoutput: bool = field(default=False, metadata=_help("runtime",
        "free each sent activation's data once its send ends, keeping only its autograd "
        "graph for the backward (values the stage also reads itself are kept)"))
    # ---- data parallelism and optimizer state
    prescale_gradients: bool = field(default=False, metadata=_help("data parallel",
        "divide gradients by dp before the all-reduce"))
    gradient_predivide_factor: float = field(default=1.0, metadata=_help("data parallel",
        "divide gradients by this before the all-reduce, the rest after"))
    zero_stage: int = field(default=0, metadata=_help("data parallel",
        "0: no ZeRO; 1: shard optimizer state; 2: and gradients; 3: and parameters (2 and 3 "
        "through PyTorch FSDP2 over the dp ranks)"))
    zero_allow_untested_optimizer: bool = field(default=False, metadata=_help("data parallel",
        "let zero_stage 2/3 step an optimizer not known to be element-wise"))
    zero_allgather_bucket_size: int = field(default=500_000_000, metadata=_help("data parallel",
        "DeepSpeed's all-gather bucket: does not apply (FSDP2 gathers a block at a time)"))
    zero_reduce_bucket_size: int = field(default=500_000_000, metadata=_help("data parallel",
        "gradient all-reduce bucket, elements"))
    # ---- tensor parallelism
    tp_plan: dict | str | TPPlan | None = field(default=None, metadata=_help("tensor parallel",
        f"the tensor-parallel plan, for a model without one of its own: a merak.TPPlan "
        f"or a dict (JSON on the command line) with keys among {list(LAYER_LIST_KEYS)} "
        f"(merak.set_tp_layer_lists' arguments); becomes a TPPlan. Default: the plan "
        f"set_tp_layer_lists recorded, else the model family's"))
    parallel_vocab: bool = field(default=False, metadata=_help("tensor parallel",
        "split the embedding and LM head by vocabulary across TP ranks"))
    sequence_parallel: bool = field(default=False, metadata=_help("tensor parallel",
        "Megatron sequence parallelism in the blocks"))
    sequence_dim: int = field(default=1, metadata=_help("tensor parallel",
        "sequence dimension of hidden states"))
    tp_overlapping_level: int = field(default=0, metadata=_help("tensor parallel",
        "sub-pipelined TP: 0 off, 1 within linear pairs, 2 across attention and MLP"))
    # ---- context parallelism (the degree is merak.init's cp)
    cp_mode: str = field(default="ring", metadata=_help("context parallel",
        "attention across the sequence split when merak.init(cp=) > 1: 'ring' (K/V blocks "
        "around the ring, any head count) or 'ulysses' (all-to-all of heads and sequence; "
        "heads divisible by cp x tp)"))
    # ---- checkpoints
    save: bool = field(default=False, metadata=_help("checkpoints",
        "save Merak checkpoints every save_steps (same as save_strategy='steps')"))
    save_async: bool = field(default=False, metadata=_help("checkpoints",
        "write checkpoints in the background: a save costs the step the copy into host "
        "memory; the next save, loading, save_model and the end of training wait for it"))
    finetune: bool = field(default=False, metadata=_help("checkpoints",
        "load only the weights of resume_from_checkpoint"))
    no_save_rng: bool = field(default=False, metadata=_help("checkpoints",
        "do not save RNG states"))
    no_save_optim: bool = field(default=False, metadata=_help("checkpoints",
        "do not save optimizer state"))
    no_load_rng: bool = field(default=False, metadata=_help("checkpoints",
        "do not load RNG states"))
    no_load_optim: bool = field(default=False, metadata=_help("checkpoints",
        "do not load optimizer state"))
    # ---- mixed precision (fp16 loss scaling)
    loss_scale: float = field(default=0.0, metadata=_help("fp16", "fp16 static scale; 0 = dynamic"))
    initial_scale_power: int = field(default=16, metadata=_help("fp16",
        "dynamic scale starts at 2^this (DeepSpeed's default 16: GradScaler's 65536)"))
    loss_scale_window: int = field(default=1000, metadata=_help("fp16",
        "steps without overflow before the scale grows"))
    hysteresis: int = field(default=2, metadata=_help("fp16",
        "overflows absorbed before the first halving; once used up, every overflow halves "
        "until the scale grows again"))
    consecutive_hysteresis: bool = field(default=False, metadata=_help("fp16",
        "restore the hysteresis allowance on every step without overflow"))
    min_loss_scale: float = field(default=1.0, metadata=_help("fp16", "lowest dynamic scale"))
    # ---- fp8 (torchao's float8 linears; pip install merak3d[fp8])
    fp8: str | None = field(default=None, metadata=_help("fp8",
        "train the stage's linear layers in float8 through torchao: 'tensorwise' or 'rowwise' "
        "dynamic scales (emulated without an fp8 GPU); the LM head, MoE routers and layers "
        "whose features do not divide by 16 stay in high precision, as do LoRA adapters"))
    fp8_exclude: list[str] | None = field(default=None, metadata=_help("fp8",
        "module-name patterns (globs matched anywhere in the name, e.g. 'layers.0.*' or "
        "'down_proj') kept in high precision under fp8"))
    # ---- evaluation and generation
    eval_iters: int | None = field(default=None, metadata=_help("evaluation",
        "evaluation steps per evaluate() (default: the whole eval set)"))
    text_generation: bool = field(default=False, metadata=_help("evaluation",
        "generate after training, with the pipelined model and a KV cache, for the trainer's "
        "generation_prompts (else the first eval rows' first halves); written to "
        "<output_dir>/generations.jsonl"))
    out_seq_length: int = field(default=1024, metadata=_help("evaluation",
        "new tokens generated per prompt (text_generation, and trainer.generate's default)"))
    temperature: float = field(default=0.9, metadata=_help("evaluation",
        "sampling temperature of text_generation (0: greedy decoding)"))
    # ---- LoRA
    lora_config: str | None = field(default=None, metadata=_help(
        "LoRA", "peft LoraConfig fields as a JSON file, a directory with adapter_config.json, "
        "or JSON text: the model is wrapped with peft before the 3D build"))
    adapter_name: str = field(default="default", metadata=_help(
        "LoRA", "the name of the adapter lora_config adds (and that exports write)"))
    # ---- energy (Perseus)
    energy_gpu: str | None = field(default=None, metadata=_help("energy",
        "GPU clock control and energy counter: 'nvml' (NVIDIA GPUs) or 'simulated' "
        "(the synthetic GPU model, for CPU machines); measures every step's time and "
        "energy (output_dir/energy_steps.csv) and is needed by the options below"))
    simulated_gpu: str | None = field(default=None, metadata=_help("energy",
        "JSON overrides of the simulated GPU model, e.g. "
        "'{\"forward_s\": 0.01, \"clock_step\": 90}' (merak.energy.profiling.gpu."
        "SyntheticGPUModel)"))
    energy_profile: str | None = field(default=None, metadata=_help("energy",
        "profile mode: train() measures every compute instruction at each GPU clock, "
        "writes this CSV (for `merak energy plan`) and returns"))
    energy_plan: str | None = field(default=None, metadata=_help("energy",
        "a `merak energy plan` JSON: per-instruction GPU clocks for every rank"))
    pfo_server_url: str | None = field(default=None, metadata=_help("energy",
        "a Perseus (Zeus PFO) server to fetch the energy plan from, e.g. "
        "http://127.0.0.1:7787 (`merak energy serve`)"))
    energy_mode: str | None = field(default=None, metadata=_help("energy",
        "'auto': profile, plan and deploy inside the training run: the first steps profile "
        "a few clocks, the plan is computed in the background while training goes on at "
        "maximum clocks and deployed on every rank at once (output_dir/energy/)"))
    energy_max_slowdown: float = field(default=0.01, metadata=_help("energy",
        "energy_mode='auto': the step time the plan may add, a fraction of the all-max "
        "step (0.01: one percent)"))
    energy_replan_margin: float = field(default=0.1, metadata=_help("energy",
        "energy_mode='auto': re-profile and re-plan when the measured step time drifts past "
        "the plan's prediction by more than this fraction"))

    def __init_subclass__(cls, **kwargs):
        """A config combining MerakArguments with another TrainingArguments subclass keeps
        each field's default from the class that declared it (`config_bases`)."""
        super().__init_subclass__(**kwargs)
        keep_declared_defaults(cls)

    def __post_init__(self) -> None:
        check_ranges(self)  # every number in its range, before anything reads one
        self._check_auto_parallel()
        self._check_gradient_checkpointing()
        self._check_tp_plan()
        self._check_choices()
        self._check_buckets_and_scaler()
        self._check_fp8()
        self._check_inherited()
        check_compile_mode(self.torch_compile_mode)
        rules.check(rules.Choices.from_arguments(self))  # the combinations (merak.rules)
        if self.lora_config is not None:  # a bad config fails here, before any work
            from merak.lora import load_lora_config

            load_lora_config(self.lora_config)
        super().__post_init__()

    # what a plan chooses: the user leaves these at their defaults
    PLANNED = ("train_schedule", "num_model_chunks", "zero_stage", "activation_checkpointing",
               "activation_checkpoint_ratio", "activation_memory_budget", "sequence_parallel",
               "recompute_in_backward", "cp_mode")

    def to_dict(self) -> dict[str, Any]:
        serialized = super().to_dict()
        if isinstance(self.tp_plan, TPPlan):  # JSON-friendly (its fields may hold functions)
            serialized["tp_plan"] = repr(self.tp_plan)
        return serialized

    @property
    def plans_recomputation(self) -> bool:
        """Recomputation chosen from a measurement (`merak.trainer.recomputation`): one
        activation_checkpoint_ratio (stage-aware) or activation_memory_budget."""
        return self.activation_checkpointing and (
            self.activation_memory_budget is not None
            or len(self.activation_checkpoint_ratio or ()) == 1)

    def engine_options(self, *, pp: int, dp: int = 1,
                       leaf_modules: tuple[str, ...] = ()) -> EngineOptions:
        """The engine's options these arguments describe for a job of `pp` pipeline ranks and
        `dp` data-parallel ranks (`leaf_modules`: the modules the split keeps opaque)."""
        return engine_options_of(self, pp=pp, dp=dp, leaf_modules=leaf_modules)

    @property
    def gradient_bucket_bytes(self) -> int:
        """The dp all-reduce bucket: HF's ddp_bucket_cap_mb when given, else Merak's
        zero_reduce_bucket_size (fp32 elements)."""
        if self.ddp_bucket_cap_mb is not None:
            return int(self.ddp_bucket_cap_mb * 2**20)
        return self.zero_reduce_bucket_size * 4

    @property
    def place_model_on_device(self) -> bool:
        return False  # MerakTrainer materializes each rank's own stage on its device
