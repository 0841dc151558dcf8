"""The `merak` command line (also `python -m merak`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from merak.coverage.cli import add_coverage
from merak.dryrun.cli import add_plan
from merak.energy.cli import add_energy
from merak.generation.cli import add_generate
from merak.inputs import InputError
from merak.schedule.simulate_cli import add_simulate
from merak.tensor_parallel.apply.cli import add_tp_plan


def _add_export(subparsers) -> None:
    parser = subparsers.add_parser(
        "export", help="write a Merak checkpoint as a plain HF save_pretrained directory")
    parser.add_argument("checkpoint", help="a checkpoint-<step> directory")
    parser.add_argument("out_dir", help="where to write config.json and model.safetensors "
                                        "(for a LoRA checkpoint: a PEFT adapter directory)")
    parser.add_argument("--merge", action="store_true",
                        help="LoRA: write the base model with the adapter merged in instead")
    parser.set_defaults(run=_export)


def _export(args: argparse.Namespace) -> int:
    """Exit status 1, with what is missing or malformed, for a checkpoint that is not whole:
    nothing is written then (an export of part of a model would load with the rest random)."""
    from merak.checkpoint.export import export_checkpoint
    from merak.checkpoint.files import CheckpointError

    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, merge=args.merge)
    except CheckpointError as error:
        print(f"merak export: error: {error}", file=sys.stderr)
        return 1
    print(f"exported {args.checkpoint} to {out}")
    return 0


def _add_checkpoint(subparsers) -> None:
    parser = subparsers.add_parser("checkpoint", help="look inside Merak checkpoints")
    commands = parser.add_subparsers(dest="checkpoint_command", required=True)
    info = commands.add_parser("info", help="print a checkpoint's layout, step, size, tensors "
                                            "and optimizer states, and whether it is complete")
    info.add_argument("checkpoint", nargs="+", help="checkpoint-<step> directories")
    info.set_defaults(run=_checkpoint_info)


def _checkpoint_info(args: argparse.Namespace) -> int:
    """Exit status 1 when any checkpoint named is not complete."""
    from merak.checkpoint.files import is_complete
    from merak.checkpoint.info import describe

    for path in args.checkpoint:
        print(describe(path))
    return 0 if all(is_complete(Path(p)) for p in args.checkpoint) else 1


class _Parser(argparse.ArgumentParser):
    """Refuses bad arguments in one line (its subcommands' parsers are of this class too)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    """Runs one command; exit status 2, with a one-line reason, for invalid arguments or
    input files (`merak.inputs`)."""
    parser = _Parser(prog="merak", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_simulate(subparsers)
    _add_export(subparsers)
    _add_checkpoint(subparsers)
    add_energy(subparsers)
    add_coverage(subparsers)
    add_generate(subparsers)
    add_plan(subparsers)
    add_tp_plan(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except InputError as error:
        command = " ".join(x for x in ("merak", args.command, getattr(args, "energy_command", None))
                           if x)
        print(f"{command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
