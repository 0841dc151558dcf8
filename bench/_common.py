"""Shared by the benches: where results go, a free port for torchrun, and the one way a bench
builds a training engine (`build`, through `merak.engine.assemble.build_engine`, as
`MerakTrainer` and the planner's dry runs do). The benches import nothing from tests/."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"  # every bench's default output directory


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_options(**fields):
    """The `EngineOptions` of a bench's engine (the only place the benches make one): each
    field by name goes to the options object of `EngineOptions` that declares it
    (``num_microbatches`` to ``pipeline``, ``zero_stage`` to ``precision``, ...)."""
    import dataclasses

    from merak.engine.options import EngineOptions
    from merak.options import by_class

    groups = [f.name for f in dataclasses.fields(EngineOptions)]
    defaults = EngineOptions()
    kinds = [type(getattr(defaults, group)) for group in groups]
    parts = by_class(fields, kinds, "engine_options")
    return EngineOptions(**{group: kind(**part) for group, kind, part in zip(groups, kinds, parts)
                            if part})


def build(model, example, ctx, make_optimizer=None, checkpoint=None, **fields):
    """This rank's engine (`merak.engine.assemble.Engine`: stage, optimizer, interpreter) for
    `model` from one micro-batch `example`; `fields` are `EngineOptions` fields."""
    from merak.engine.assemble import build_engine, default_optimizer

    return build_engine(model, example, ctx, engine_options(**fields),
                        make_optimizer=make_optimizer or default_optimizer,
                        checkpoint=checkpoint)


def launch_self(script: str, ranks: int) -> tuple[dict, float]:
    """Run `script` again on `ranks` gloo ranks under torchrun, with this process's arguments
    plus ``--worker --out FILE`` (the script's worker writes its report, JSON, to FILE):
    (the report, the seconds the launch took)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                            os.environ.get("PYTHONPATH")])))
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "torch.distributed.run",
                        f"--nproc_per_node={ranks}", f"--master_port={free_port()}", script,
                        "--worker", "--out", str(out), *sys.argv[1:]], env=env, check=True)
        return json.loads(out.read_text()), time.perf_counter() - start
