"""The one rule set: which combinations of a job's options Merak refuses, and why.

`MerakArguments` (when it is made), the strategy search's candidate list and the automatic plan
(when it sets the arguments to its choice) all ask `refusal`, so the planner never proposes a
layout the trainer would refuse. A rule here is about *combinations* (ZeRO-3 with a split
backward); a single field's range (a positive count) is checked where the field is read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from merak.distributed.parallel_context import default_context
from merak.schedule.registry import SCHEDULES, ScheduleInfo

_UNREGISTERED = ScheduleInfo("", None)  # a `Schedule` object: its interpreter checks it


class NotSupportedYetError(ValueError):
    """A field asks for a feature Merak does not have yet."""


@dataclass(frozen=True)
class Choices:
    """The option values the rules read: `from_arguments` takes them from `MerakArguments`;
    the planner varies the schedule, ZeRO stage, recomputation and sequence parallelism of
    the job's own (`with_candidate`)."""

    train_schedule: str = "1f1b"
    zero_stage: int = 0
    activation_checkpointing: bool = False
    sequence_parallel: bool = False
    lora: bool = False                 # LoRA adapters (lora_config, or a peft model)
    torch_compile: bool = False
    auto_find_batch_size: bool = False
    divides_gradients: bool = False    # prescale_gradients or gradient_predivide_factor != 1
    text_generation: bool = False
    tp_overlapping_level: int = 0
    cp: int = 1                        # context parallelism (merak.init's cp)
    cp_mode: str = "ring"
    packing: bool = False              # packed / padding-free rows (TRL's packing, padding_free)
    fp8: str | None = None             # torchao float8 linears' recipe (merak.engine.fp8)
    fp16: bool = False
    tp: int = 1                        # tensor parallelism (merak.init's tp)
    ep: int = 1                        # expert parallelism (merak.init's ep)
    planned: bool = False              # auto_parallel or a plan file chooses the layout

    @classmethod
    def from_arguments(cls, args, *, lora: bool | None = None, cp: int | None = None
                       ) -> Choices:
        """The choices of `MerakArguments` `args` (read by field name); `lora`: whether the
        model carries adapters (default: whether `args.lora_config` asks for them); `cp`: the
        context-parallel degree (default: the one of the last `merak.init`, else 1); the
        tensor- and expert-parallel degrees: the last `merak.init`'s, else 1."""
        values = {f.name: getattr(args, f.name) for f in fields(cls)
                  if f.name not in ("lora", "divides_gradients", "cp", "packing", "tp", "ep",
                                    "planned")
                  and hasattr(args, f.name)}
        values["lora"] = args.lora_config is not None if lora is None else lora
        context = default_context()
        if cp is None:
            cp = context.cp if context is not None else 1
        values["cp"] = cp
        values["tp"] = context.tp if context is not None else 1
        values["ep"] = context.ep if context is not None else 1
        values["planned"] = bool(getattr(args, "auto_parallel", False)
                                 or getattr(args, "plan", None))
        values["packing"] = bool(getattr(args, "packing", False)
                                 or getattr(args, "padding_free", False))
        values["divides_gradients"] = bool(args.prescale_gradients) \
            or args.gradient_predivide_factor != 1.0
        return cls(**values)

    def with_candidate(self, candidate) -> Choices:
        """These choices with a planner candidate's (`candidate_fields`): schedule, ZeRO
        stage, recomputation, sequence parallelism, context, tensor and expert parallelism."""
        chosen = candidate_fields(candidate)
        own = {f.name for f in fields(self)}
        return replace(self, **{k: v for k, v in chosen.items() if k in own},
                       cp=candidate.cp, tp=candidate.tp, ep=candidate.ep)


def candidate_fields(candidate, recompute_ratios=None) -> dict:
    """The `MerakArguments` field values a strategy search candidate chooses: the one mapping
    of a candidate to options, which the automatic plan writes into the arguments
    (`merak.trainer.auto_plan`), the rules check (`Choices.with_candidate`) and the dry runs
    build (`EngineOptions.with_candidate`). `recompute_ratios`: a ``budget`` candidate's
    per-stage ratios (its prediction's)."""
    c = candidate
    chosen = {"per_device_train_batch_size": c.micro_batch,
              "gradient_accumulation_steps": c.microbatches, "train_schedule": c.schedule,
              "zero_stage": c.zero, "sequence_parallel": c.sequence_parallel,
              "activation_checkpointing": c.recompute != "off",
              "recompute_in_backward": c.recompute == "block",
              "cp_mode": getattr(c, "cp_mode", "ring")}
    if c.chunks > 1:
        chosen["num_model_chunks"] = c.chunks
    if c.recompute == "budget" and recompute_ratios:
        chosen["activation_checkpoint_ratio"] = list(recompute_ratios)
    return chosen


@dataclass(frozen=True)
class Refusal:
    """Why a combination is refused: the field to change, the message, and whether the
    combination is a missing feature (`NotSupportedYetError`) or meaningless (`ValueError`)."""

    field: str
    message: str
    not_supported_yet: bool = True

    def error(self) -> ValueError:
        return (NotSupportedYetError if self.not_supported_yet else ValueError)(self.message)


def refusal(c: Choices, owner: str = "MerakArguments") -> Refusal | None:
    """The first rule `c` breaks, or None when Merak builds it. `owner` prefixes the field
    names in the message (``MerakArguments``, or a plan's label)."""
    info = SCHEDULES.get(c.train_schedule, _UNREGISTERED)
    if c.zero_stage >= 2:
        name = f"{owner}.zero_stage={c.zero_stage}"
        if info.splits_backward:
            return Refusal("zero_stage", f"{name} with train_schedule={c.train_schedule!r} is "
                           f"not supported yet (FSDP2 cannot follow a backward split into "
                           f"input and weight halves); use 1f1b, interleaved_1f1b, gpipe or "
                           f"Merak's schedules")
        if c.divides_gradients:
            return Refusal("zero_stage", f"{name} with prescale_gradients or "
                           f"gradient_predivide_factor is not supported yet (FSDP2's "
                           f"reduce-scatter divides by dp itself); leave both at their defaults")
        for other, why in (("auto_find_batch_size", "its memory probe runs unsharded steps"),
                           ("lora", "FSDP2 would shard the frozen base weights too; untested"),
                           ("torch_compile", "compiled blocks under FSDP2 are untested")):
            if getattr(c, other):
                shown = "lora_config" if other == "lora" else other
                return Refusal("zero_stage", f"{name} with {shown} is not supported yet "
                               f"({why})")
    if info.needs_recompute and not c.activation_checkpointing:
        return Refusal("train_schedule", f"{owner}.train_schedule={c.train_schedule!r} "
                       f"reorders recomputation; set activation_checkpointing=True",
                       not_supported_yet=False)
    overlap = c.tp_overlapping_level > 0
    if c.text_generation and (c.sequence_parallel or overlap):
        return Refusal("text_generation", f"{owner}.text_generation runs without "
                       f"sequence_parallel and tp_overlapping_level (a decode step has one "
                       f"position); turn them off to generate", not_supported_yet=False)
    if c.lora and (c.sequence_parallel or overlap):
        return Refusal("sequence_parallel", f"{owner}: LoRA adapters under tensor parallelism "
                       f"work without sequence parallelism and TP overlap; set "
                       f"sequence_parallel=False and tp_overlapping_level=0",
                       not_supported_yet=False)
    return _fp8_refusal(c, owner) or _context_parallel_refusal(c, owner) \
        or _expert_parallel_refusal(c, owner)


def _fp8_refusal(c: Choices, owner: str) -> Refusal | None:
    """What fp8 (torchao's float8 linears, `merak.engine.fp8`) does not compose with yet."""
    if c.fp8 is None:
        return None
    name = f"{owner}.fp8={c.fp8!r}"
    for other, wrong, why, instead in (
            ("fp16", c.fp16, "fp16's loss scale over float8 (e5m2) gradients is untested",
             "use bf16=True or fp32 with fp8"),
            ("tp_overlapping_level", c.tp_overlapping_level > 0, "TP overlap splits each "
             "matmul into sub-batches, which would each take their own dynamic scale, and its "
             "row-parallel path multiplies outside the float8 linear",
             "use tp_overlapping_level=0 with fp8 (tp and sequence_parallel compose)")):
        if wrong:
            shown = f"{other}={getattr(c, other)!r}"
            return Refusal("fp8", f"{name} with {shown} is not supported yet ({why}); {instead}")
    return None


def _context_parallel_refusal(c: Choices, owner: str) -> Refusal | None:
    """What context parallelism (cp > 1) runs without, and why."""
    if c.cp_mode not in ("ring", "ulysses"):
        return Refusal("cp_mode", f"{owner}.cp_mode must be 'ring' or 'ulysses', got "
                       f"{c.cp_mode!r}", not_supported_yet=False)
    if c.cp == 1:
        return None
    if c.text_generation:
        return Refusal("text_generation", f"{owner}.text_generation with context parallelism "
                       f"(cp={c.cp}) is refused: a decode step has one position, nothing to "
                       f"split over the cp ranks; generate in a job without cp",
                       not_supported_yet=False)
    if c.packing:
        return Refusal("packing", f"{owner}: context parallelism (cp={c.cp}) splits one "
                       f"sequence per row; packed or padding-free rows (packing, padding_free) "
                       f"are refused", not_supported_yet=False)
    for other, why in (("tp_overlapping_level", "TP overlap's sub-batches are untested with "
                        "the cp collectives"),
                       ("lora", "adapters with a split sequence are untested"),
                       ("auto_find_batch_size", "its memory probe is untested with cp"),
                       ("torch_compile", "Dynamo would trace the attention's ring or all-to-all "
                        "as attention over the rank's own tokens")):
        if getattr(c, other):
            shown = "lora_config" if other == "lora" else other
            return Refusal(other, f"{owner}.{shown} with context parallelism (cp={c.cp}) is not "
                           f"supported yet ({why})")
    return None


def _expert_parallel_refusal(c: Choices, owner: str) -> Refusal | None:
    """What expert parallelism (ep > 1) does not combine with yet, and why."""
    if c.ep == 1:
        return None
    for other, wrong, why, instead in (
            ("tp_overlapping_level", c.tp_overlapping_level > 1 and c.tp > 1, "level 2 runs "
             "each block once per sub-batch, as coroutines interleaved at the TP all-reduces, "
             "so every MoE layer routes and exchanges its tokens over ep per sub-batch, while "
             "the load-balancing loss reads the micro-batch's router logits (a Qwen3-MoE at dp2 "
             "ep2 tp2 fails: one sub-batch's 12 rows against the micro-batch's 24)",
             "use tp_overlapping_level=1 (the attention's TP layers overlap per sub-batch, "
             "each MoE layer runs once on the micro-batch) or 0"),
            ("auto_find_batch_size", c.auto_find_batch_size, "its memory probe runs each "
             "rank's share of a step alone so that an out-of-memory error is that rank's answer; "
             "with ep every MoE layer's all-to-all is a collective over the ep group, so a rank "
             "out of memory there would leave its ep peers waiting (a hang), and the experts' "
             "memory depends on how the other ranks' tokens route",
             "set per_device_train_batch_size yourself")):
        if wrong:
            shown = f"{owner}.{other}={getattr(c, other)!r}"
            return Refusal(other, f"{shown} with expert parallelism (ep={c.ep}) is not "
                           f"supported yet ({why}); {instead}, or ep=1")
    return None


def check(c: Choices, owner: str = "MerakArguments") -> None:
    """Raise the error of the first rule `c` breaks (see `refusal`)."""
    found = refusal(c, owner)
    if found is not None:
        raise found.error()
