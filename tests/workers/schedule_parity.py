"""Every schedule, with and without recomputation, trains an auto-split HF model exactly like
the single-process model (see test_schedules_runtime)."""

from __future__ import annotations

import os

import torch
from common import GradSnapshot, assert_close, assert_close_grad, run_scenarios
from hf_models import FAMILIES, batch

import merak
from merak.partition.auto import auto_split
from merak.partition.meta import materialize_

STEPS, MICROBATCHES, ROWS, LR, SEED = 3, 4, 2, 0.05, 1234
FAMILY_NAMES = ("llama", "gpt2")

# name -> interpreter options
VARIANTS = {
    "1f1b": {"schedule": "1f1b"},
    "1f1b-recompute": {"schedule": "1f1b", "recompute_ratio": 1.0},
    "1f1b-stage-aware-chunk2": {"schedule": "1f1b", "recompute_ratio": "falling",
                                "checkpoint_num_layers": 2},
    "ds_default-recompute": {"schedule": "ds_default", "recompute_ratio": 1.0},
    "pre_recompute_1f1b": {"schedule": "pre_recompute_1f1b", "recompute_ratio": 1.0},
    "last_no_recompute_1f1b": {"schedule": "last_no_recompute_1f1b", "recompute_ratio": 1.0},
    "shifted_critical_path": {"schedule": "shifted_critical_path", "recompute_ratio": 1.0},
    "zero_bubble": {"schedule": "zero_bubble"},
    "zero_bubble-recompute": {"schedule": "zero_bubble", "recompute_ratio": 0.5},
}


def scenario_names(world_size: int) -> list[str]:
    return [f"{family}-pp{world_size}-{variant}" for family in FAMILY_NAMES
            for variant in VARIANTS]


class _Family:
    """One family's split, initial stage weights and single-process reference, built once."""

    def __init__(self, family: str, pp: int):
        self.family, self.ctx = family, merak.init(dp=1, tp=1, pp=pp)
        torch.manual_seed(SEED)
        with merak.init_empty_weights():
            model = FAMILIES[family]()
        self.split = auto_split(model, batch(family, 0, ROWS), pp)
        self.stage = merak.PipelineStage(self.split.container, self.split, self.ctx.stage_id)
        materialize_(self.stage)
        self.initial = {k: v.clone() for k, v in self.stage.state_dict().items()}
        torch.manual_seed(SEED)
        reference = FAMILIES[family]()
        params = dict(reference.named_parameters())
        optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
        self.losses, self.grads = [], []
        for step in range(STEPS):
            out = reference(**batch(family, step, ROWS * MICROBATCHES))
            out.loss.backward()
            self.losses.append(out.loss.item())
            self.grads.append({n: p.grad.clone() for n, p in params.items()})
            optimizer.step()
            optimizer.zero_grad()
        self.final = {n: p.detach().clone() for n, p in params.items()}

    def check(self, variant: str) -> None:
        options = dict(VARIANTS[variant])
        pp = self.ctx.pp
        if options.get("recompute_ratio") == "falling":  # stage-aware: later stages recompute less
            options["recompute_ratio"] = [1.0 - s / pp for s in range(pp)]
        self.stage.load_state_dict(self.initial)
        snapshot = GradSnapshot(self.stage)
        engine = merak.PipelineInterpreter(
            self.stage, self.ctx, torch.optim.SGD(self.stage.parameters(), lr=LR),
            MICROBATCHES, hooks=[snapshot], p2p_timeout_s=120, **options)
        try:
            kinds = {a.kind.value for a in engine.actions}
            if options.get("recompute_ratio") == 1.0 and variant != "1f1b-recompute" and \
                    not self.ctx.is_last_stage:
                assert "recompute" in kinds, f"{variant}: stage {self.ctx.stage_id} never recomputes"
            losses = [engine.train_step(batch(self.family, step, ROWS * MICROBATCHES))
                      for step in range(STEPS)]
        finally:
            engine.recompute.remove()
        for step in range(STEPS):
            assert_close(torch.tensor(losses[step]), torch.tensor(self.losses[step]),
                         f"{variant}: loss of step {step}")
            for name, grad in snapshot.grads[step].items():
                assert_close_grad(grad, self.grads[step][name], f"{variant}: step {step} {name}")
        own = dict(self.stage.named_parameters())
        assert set(snapshot.grads[0]) == set(own), f"{variant}: parameters without gradient"
        for name, param in own.items():
            assert_close(param.detach(), self.final[name], f"{variant}: {name} after training")


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    families: dict[str, _Family] = {}

    def scenario(family: str, variant: str):
        def run() -> None:
            if family not in families:
                families[family] = _Family(family, world)
            families[family].check(variant)
        return run

    run_scenarios({f"{f}-pp{world}-{v}": scenario(f, v) for f in FAMILY_NAMES for v in VARIANTS})


if __name__ == "__main__":
    main()
