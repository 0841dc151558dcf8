"""Initialization replay of a meta build: each parameter (and buffer) a stage materializes gets
the value the seeded eager build gives it, whatever its init reads (computed temporaries, other
parameters, even another stage's, real draws) and however its init draws."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from merak.materialize.meta import init_empty_weights, materialize_


def _assert_materializes_like_eager(build, seed: int) -> None:
    torch.manual_seed(seed)
    eager = build()
    after = torch.rand(4)  # the generator ends where the eager build left it
    torch.manual_seed(seed)
    with init_empty_weights():
        model = build()
    materialize_(model)
    for (name, mine), theirs in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(mine, theirs), name
    for (name, mine), theirs in zip(model.named_buffers(), eager.buffers()):
        assert torch.equal(mine, theirs), name
    assert torch.equal(torch.rand(4), after)


class _DrawnParameters(nn.Module):
    """Random draws on meta (Linear) around a parameter drawn for real (`torch.normal`, as
    DiffLlama's lambdas): the real draw happens at another point of the generator's sequence."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.lam = nn.Parameter(torch.normal(0, 0.1, size=(5,)))
        self.b = nn.Linear(5, 3)
        nn.init.normal_(self.a.weight)


def test_a_parameter_drawn_for_real_gets_the_eager_value_and_later_draws_too():
    _assert_materializes_like_eager(_DrawnParameters, seed=3)


class _ComputedInit(nn.Module):
    """Mamba's pattern: parameters copied from temporaries computed at init (``log(arange)``,
    ``exp(rand)``, a temporary drawn in place), between ordinary random inits."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.A_log = nn.Parameter(torch.empty(3, 4))
        self.dt = nn.Parameter(torch.empty(4))
        self.b = nn.Linear(4, 2)
        with torch.no_grad():
            A = torch.arange(1, 5, dtype=torch.float32, device=self.A_log.device)[None, :]
            self.A_log.copy_(torch.log(A.expand(3, -1).contiguous()))
            dt = torch.exp(torch.rand(4, device=self.dt.device) * 2.0).clamp(min=1.1)
            self.dt.copy_(dt + torch.empty(4, device=self.dt.device).uniform_(0, 1))


def test_parameters_copied_from_computed_temporaries_get_the_eager_values():
    _assert_materializes_like_eager(_ComputedInit, seed=5)


class _CopiedAcrossStages(nn.Module):
    """Inits that read parameters: the head starts as a scaled copy of the input projection
    (another pipeline stage's parameter, re-drawn after it was read), a bias as the log of its
    own draw (Kimi's ``A_log``), a temporary shaped like a parameter then filled in part
    (HY's ``zeros_like(base)``), a list made on the meta device (RWKV's ``torch.tensor``)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(12, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 12)
        bias = self.blocks[1].bias
        with torch.no_grad():
            self.head.weight.copy_(self.proj.weight.t() * 0.5)
            nn.init.normal_(self.proj.weight)  # the source changes after it was read
            self.head.bias.copy_(nn.init.uniform_(self.head.bias, 1.0, 2.0).log())
            base = torch.zeros_like(bias)
            base[:4] = -0.5
            steps = torch.tensor([0.25 * i for i in range(16)], device=bias.device)
            bias.copy_(base + steps * torch.ones_like(bias * 3))

    def forward(self, x, labels):
        h = self.proj(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_parameters_copied_from_other_parameters_get_the_eager_values():
    _assert_materializes_like_eager(_CopiedAcrossStages, seed=11)


def test_a_stage_rebuilds_a_source_parameter_another_stage_holds():
    import merak

    torch.manual_seed(11)
    eager = _CopiedAcrossStages()
    after = torch.rand(4)
    torch.manual_seed(11)
    with init_empty_weights():
        model = _CopiedAcrossStages()
    inputs = {"x": torch.randn(2, 6, 12), "labels": torch.randint(0, 12, (2, 6))}
    split = merak.auto_split(model, inputs, 2, trace_method="fx")
    last = merak.PipelineStage(split.container, split, 1)
    assert materialize_(last)
    assert model.proj.weight.is_meta  # the source stays on the other stage, unmaterialized
    assert not model.head.weight.is_meta and not model.blocks[1].bias.is_meta
    for name, param in eager.named_parameters():
        mine = model.get_parameter(name)
        assert mine.is_meta or torch.equal(mine, param), name
    torch.testing.assert_close(torch.rand(4), after, rtol=0, atol=0)


class _SkippedOnMeta(nn.Module):
    """`torch.nn.init` functions that return at once on a meta tensor, some drawing as many
    times as the values drawn ask (`trunc_normal_` rejects and redraws; RWKV's `orthogonal_`),
    directly and through HF's wrappers, between ordinary draws."""

    def __init__(self):
        from transformers import initialization as hf_init

        super().__init__()
        self.a = nn.Linear(8, 6)
        self.conv = nn.Conv1d(4, 4, 3)
        self.b = nn.Linear(6, 5)
        with torch.no_grad():
            nn.init.trunc_normal_(self.a.weight, std=0.5, a=-0.4, b=0.4)
            hf_init.trunc_normal_(self.a.bias, std=0.02)
            nn.init.dirac_(self.conv.weight)
            nn.init.sparse_(self.b.weight, 0.3)
            hf_init.orthogonal_(self.b.weight, gain=0.5)
        self.c = nn.Linear(3, 3)


def test_inits_that_skip_meta_tensors_run_at_replay():
    _assert_materializes_like_eager(_SkippedOnMeta, seed=2)
    assert torch.nn.init.orthogonal_(torch.empty(3, 3, device="meta")).is_meta  # undone


class _RealDraws(nn.Module):
    """Real draws after meta ones (which left the generator behind, so their values here are
    not the eager build's): Nemotron-H's ``dt`` computed from ``torch.rand`` on the CPU and
    copied in, and buffers drawn in whole or in part."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.dt_bias = nn.Parameter(torch.empty(4))
        self.register_buffer("noise", torch.randn(5), persistent=False)
        self.register_buffer("mixed", torch.zeros(6))
        self.mixed[:3].uniform_()
        with torch.no_grad():
            dt = torch.exp(torch.rand(4) * 2.0).clamp(min=1.1)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.b = nn.Linear(4, 2)


def test_values_computed_from_real_draws_get_the_eager_values():
    _assert_materializes_like_eager(_RealDraws, seed=4)


def test_reading_values_that_were_not_recorded_is_refused():
    outside = torch.empty(3, device="meta")  # made outside the context: no values recorded

    class FromOutside(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.empty(3))
            with torch.no_grad():
                self.p.copy_(outside * 2)

    class ChangedSource(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.empty(3))
            source = torch.ones(3)
            with torch.no_grad():
                self.p.copy_(source)
            source.add_(1)  # in place, after the copy read it: that value is gone

    for build, match in ((FromOutside, "no recorded op gave all its values"),
                         (ChangedSource, "modified in place afterwards")):
        with init_empty_weights():
            model = build()
        with pytest.raises(ValueError, match=match):
            materialize_(model)
    with pytest.raises(NotImplementedError, match="Generator of its own"):
        with init_empty_weights():
            nn.init.normal_(nn.Linear(2, 2).weight, generator=torch.Generator())
