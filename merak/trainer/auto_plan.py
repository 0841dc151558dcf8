"""`MerakArguments(auto_parallel=True)` and `MerakArguments(plan=...)`: the layout (ep
included: kept at the one `merak.init(ep=)` gave, `expert_parallel_degrees`), micro-batching,
schedule, recomputation and ZeRO stage come from `merak.strategy`, applied before the model is
built (every rank reaches the same plan: the planner's measurements are shared and its dry runs
are collectives)."""

from __future__ import annotations

from pathlib import Path

from merak import lora, rules
from merak.distributed.parallel_context import ParallelContext, init
from merak.strategy.candidate import Candidate
from merak.strategy.reference import ReferenceCosts
from merak.strategy.search import read_strategy_plan
from merak.trainer.subclasses import reference_trainer


def global_batch(args) -> int:
    """The sequences of one optimizer step under a plan: what one process would step on."""
    return args.per_device_train_batch_size * args.gradient_accumulation_steps


def reference_costs(trainer) -> ReferenceCosts | None:
    """Where the trainer runs a preference trainer's reference forwards (TRL's DPOTrainer and
    KTOTrainer; None for other trainers), for the strategy planner as `merak plan --reference`
    takes them: ``"replica"`` with ``sync_ref_model`` (the explicit reference's replica runs
    before every step and is held through training, `merak.trainer.reference_sync`), else
    ``"before"``: precomputed references, the config's defaults, LoRA with its adapters off and
    an explicit ``ref_model`` all run one forward-only pass over the training rows before the
    first step (`merak.trainer.reference_logps`; an explicit reference's replica is freed
    after it, before any gradient or optimizer state exists). The epochs are those the
    trainer will train (``max_steps`` global batches over the training set, else
    ``num_train_epochs``)."""
    if reference_trainer(type(trainer)) is None:
        return None
    args = trainer.args
    mode = "replica" if getattr(args, "sync_ref_model", False) else "before"
    epochs = args.num_train_epochs
    if args.max_steps > 0 and trainer.train_dataset is not None:
        epochs = args.max_steps * global_batch(args) / len(trainer.train_dataset)
    return ReferenceCosts(mode, epochs)


def sequence_parallel_settings(args, config, ctx) -> tuple[bool, ...]:
    """What the planner may try: sequence parallelism where the TP plan the job will use
    can split the sequence (what else excludes it is `merak.rules`')."""
    from merak.strategy.search import sequence_parallel_choices
    from merak.tensor_parallel.plans.tp_plan import registered_plan

    return sequence_parallel_choices(config, args.tp_plan or registered_plan(ctx))


def expert_parallel_degrees(config, ctx) -> tuple[int, ...] | None:
    """The ep degrees auto_parallel may choose: the one ``merak.init(ep=)`` gave when it is
    above 1 (the layouts searched are then those whose dp divides by it), else every degree
    that divides a layout's dp and the experts (None)."""
    if ctx.ep == 1:
        return None
    from merak.strategy.shape import ModelShape

    if not ModelShape.from_config(config).experts:
        raise ValueError(f"merak.init(ep={ctx.ep}) with auto_parallel: the model's config "
                         f"({type(config).__name__}) names no experts, so there is nothing to "
                         f"split over ep; call merak.init() without ep for a dense model")
    return (ctx.ep,)


def apply_strategy_plan(trainer, example_rows: dict) -> ParallelContext:
    """Plan (auto_parallel) or read the plan file, set the trainer's arguments to it and
    re-initialize the parallel context with its degrees; returns the new context."""
    args, ctx = trainer.args, trainer.ctx
    job = rules.Choices.from_arguments(args, lora=lora.is_peft_model(trainer.model))
    if args.plan:
        candidate, ratios, planned = read_strategy_plan(args.plan)
        if planned is not None and planned != global_batch(args):
            raise ValueError(f"{args.plan} was made for a global batch of {planned} sequences, "
                             f"but per_device_train_batch_size x gradient_accumulation_steps = "
                             f"{global_batch(args)}; set them to {planned} x 1 or plan again")
    else:
        from merak.dryrun.online import plan_online

        model = trainer.model
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError("auto_parallel plans an HF causal LM from its config; "
                             f"{type(model).__name__} has none (give merak.init the degrees)")
        if "input_ids" not in example_rows:
            raise ValueError(f"auto_parallel plans a causal LM trained on input_ids; the batches "
                             f"hold {sorted(example_rows)} (plan offline with `merak plan` and "
                             f"give MerakArguments(plan=...), or give merak.init the degrees)")
        seq = example_rows["input_ids"].shape[-1]
        expert_parallel = expert_parallel_degrees(config, ctx)  # (before measuring anything)
        # the dry runs build the trainer's engine: its options, with each candidate's choices
        options = args.engine_options(pp=1, dp=ctx.world_size,
                                      leaf_modules=trainer.leaf_modules)
        plan = plan_online(config, global_batch(args), seq,
                           args.plan_memory_gib * 2**30 if args.plan_memory_gib else None,
                           dry_runs=args.plan_dry_runs,
                           sequence_parallel=sequence_parallel_settings(args, config, ctx),
                           options=options, job=job, expert_parallel=expert_parallel,
                           reference=reference_costs(trainer))
        if ctx.rank == 0:
            print(plan.table(), f"\nchosen: {plan.chosen.label}\n{plan.why}", flush=True)
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            plan.write(Path(args.output_dir) / "plan.json")
        candidate = plan.chosen
        ratios = plan.chosen_prediction().recompute_ratios
    size = candidate.dp * candidate.tp * candidate.pp * candidate.cp  # (ep adds no ranks)
    if size != ctx.world_size:
        raise ValueError(f"the plan's layout {candidate.label} needs {size} ranks, this job "
                         f"has {ctx.world_size}")
    found = rules.refusal(job.with_candidate(candidate), owner=f"the plan {candidate.label}")
    if found is not None:  # a plan file made for another job's options
        raise found.error()
    _set_arguments(args, candidate, ratios)
    trainer._train_batch_size = candidate.micro_batch  # what evaluation cuts micro-batches by
    return init(candidate.dp, candidate.tp, candidate.pp, cp=candidate.cp, ep=candidate.ep)


def _set_arguments(args, c: Candidate, ratios: list[float] | None) -> None:
    for name, value in rules.candidate_fields(c, ratios).items():
        setattr(args, name, value)
