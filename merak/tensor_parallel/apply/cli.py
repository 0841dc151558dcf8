"""`merak tp-plan FAMILY`: the tensor-parallel plan Merak uses for a family, as a `TPPlan`.

    python -m merak tp-plan bloom [--tp 2] [--infer] [--config path/or/hub-dir]

The model is built on the meta device from the family's default config (or `--config`, a
directory holding a config.json) and its plan printed as the Python expression of a `TPPlan`,
the form of Merak's hand-written plans (`FAMILY_PLANS`): copy it, adjust it and pass it as
``MerakArguments(tp_plan=TPPlan(...))`` or ``merak.parallelize(..., tp_plan=...)``. The plan is
the one training would use (the hand plan, else the config's ``base_model_tp_plan``, else the
plan inferred from the blocks); `--infer` shows the inferred one whatever the family has. The
layers inference leaves replicated are listed after it, with the reason.
"""

from __future__ import annotations

import argparse
import sys


def add_tp_plan(subparsers) -> None:
    parser = subparsers.add_parser(
        "tp-plan", help="print a family's tensor-parallel plan (inferred where it has none)")
    parser.add_argument("family", help="a model type of the installed transformers (llama, "
                                       "bloom, ...), or a directory holding a config.json")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    parser.add_argument("--infer", action="store_true",
                        help="infer the plan from the blocks even where the family has one")
    parser.set_defaults(run=run_tp_plan)


def _config(family: str):
    import transformers as tf

    try:
        return tf.AutoConfig.for_model(family)
    except ValueError:
        return tf.AutoConfig.from_pretrained(family)


def plan_text(config, tp: int = 2, infer: bool = False) -> str:
    """The header and the plan `merak tp-plan` prints for `config`."""
    import transformers as tf

    from merak.materialize.meta import init_empty_weights
    from merak.tensor_parallel.apply.choice import config_plan
    from merak.tensor_parallel.apply.infer import format_plan, infer_plan

    with init_empty_weights():
        model = tf.AutoModelForCausalLM.from_config(config)
    plan = None if infer else config_plan(config)
    plan = plan or infer_plan(model, tp)
    origin = {"table": "Merak's hand-written plan (FAMILY_PLANS)",
              "base_model_tp_plan": "the config's base_model_tp_plan",
              "inferred": "inferred from the blocks, proven on each rank before training"
              }.get(plan.source, plan.source)
    header = f"# {config.model_type} at tp={tp}: {origin}\nfrom merak import TPPlan\n\n"
    return header + "plan = " + format_plan(plan, config)


def run_tp_plan(args: argparse.Namespace) -> int:
    try:
        config = _config(args.family)
        print(plan_text(config, args.tp, args.infer))
    except (ValueError, OSError) as error:
        print(f"merak tp-plan: error: {error}", file=sys.stderr)
        return 1
    return 0
