"""Trace a meta-built model as if its weights lived on the device it will train on.

A model built under `merak.init_empty_weights()` has its parameters on the meta device. Tracing
it there bakes in the code paths a model takes for ``device.type == "meta"``: transformers'
MoE code, for one, counts tokens per expert with ``histc`` on integers except on CPU, where
``histc`` needs floats, so a graph traced on meta fails on CPU. While tracing, every parameter
and buffer is swapped for a fake tensor (no storage) on the target device, so the traced graph
is the one that device runs; the meta tensors (and their materialization records) come back
right after the export.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode


class FakeWeights:
    """``with FakeWeights(model, device) as fake:`` trace with ``fake.inputs(example)``; call
    ``fake.restore()`` (idempotent) as soon as the export is done."""

    def __init__(self, model: nn.Module, device: torch.device | str):
        self.model, self.device = model, torch.device(device)
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._saved: list[tuple[dict, str, torch.Tensor]] = []

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        with self.mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.device)

    def __enter__(self) -> FakeWeights:
        memo: dict[int, torch.Tensor] = {}  # tied tensors stay one tensor
        for module in self.model.modules():
            for table, is_param in ((module._parameters, True), (module._buffers, False)):
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    if id(t) not in memo:
                        fake = self._fake(t)
                        memo[id(t)] = nn.Parameter(fake, t.requires_grad) if is_param else fake
                    self._saved.append((table, name, t))
                    table[name] = memo[id(t)]
        return self

    def inputs(self, example_inputs: dict) -> dict:
        """The example inputs as fake tensors on the device (shapes and dtypes only, as on meta)."""
        return {k: self._fake(v) if isinstance(v, torch.Tensor) else v
                for k, v in example_inputs.items()}

    def restore(self) -> None:
        for table, name, t in reversed(self._saved):
            table[name] = t
        self._saved.clear()

    def __exit__(self, *exc) -> None:
        self.restore()


@contextlib.contextmanager
def traceable_experts(model: nn.Module):
    """transformers' ``grouped_mm`` experts as ``batched_mm`` while tracing: torch's
    fake-tensor rule for ``_grouped_mm`` accepts bf16 only, though the CPU kernel computes fp32
    (Inkling-2 picks it by default). The trace of a block is replaced by the eager block, which
    keeps the model's own choice; only shapes come from the batched experts (which have no
    data-dependent sizes)."""
    configs = [m.config for m in model.modules() if getattr(getattr(m, "config", None),
               "_experts_implementation_internal", None) == "grouped_mm"]
    for config in configs:
        config._experts_implementation_internal = "batched_mm"
    try:
        yield
    finally:
        for config in configs:
            config._experts_implementation_internal = "grouped_mm"
