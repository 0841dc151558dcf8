"""The runner of one local stage: its micro-batches' values and its compute handlers.

The interpreter owns the program and the communication; a runner only computes: it keeps, per
micro-batch, the stage's inputs (loaded or received), the outputs it sends on, the output
gradients it received and the input gradients it sends back, and runs forward, recomputation
and (whole or split) backward on them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from merak.recompute.blocks import BlockRecomputation
from merak.recompute.meter import ActivationMeter
from merak.runtime.split_backward import backward_input, backward_weight
from merak.stages.split import PipelineSplit, ValueKey
from merak.stages.stage import PipelineStage


class OutputLoss(Protocol):
    """A loss the last stage computes eagerly from the split's output (`attach_loss`)."""

    input_names: Sequence[str]  # the batch values it reads besides the output

    def __call__(self, output: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        ...


@dataclass
class MicroBatchState:
    inputs: dict[ValueKey, torch.Tensor] = field(default_factory=dict)
    outputs: dict[ValueKey, torch.Tensor] = field(default_factory=dict)
    output_grads: dict[ValueKey, torch.Tensor] = field(default_factory=dict)
    input_grads: dict[ValueKey, torch.Tensor] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    weight_grads: object = None  # what `backward_weight` needs, between the two halves
    output_tokens: dict[ValueKey, object] = field(default_factory=dict)  # the meter's holds
    unsent: set[int] = field(default_factory=set)  # stages the outputs still go to


class StageRunner:
    """Computes one stage's share of a step.

    Args:
        stage: the stage module.
        recompute: its block recomputation (no blocks: none).
        meter: counts kept activations (None: not measured), the outputs held for backward
            included.

    Attributes:
        freeable: sent values whose data is freed once every send of them ended, keeping only
            their autograd graph (``dealloc_pipeoutput``; `PipelineStage.freeable_outputs`).
    """

    def __init__(self, stage: PipelineStage, recompute: BlockRecomputation,
                 meter: ActivationMeter | None = None):
        self.stage, self.recompute, self.meter = stage, recompute, meter
        self.split: PipelineSplit = stage.split
        self.stage_id = stage.stage_id
        self.is_last = self.stage_id == self.split.num_stages - 1
        self.read_keys = self.split.batch_inputs(self.stage_id)  # what the stage's pieces read
        self.batch_keys = list(self.read_keys)  # those and what an attached loss reads
        self.send_plan = self.split.send_plan(self.stage_id)
        self.sent_keys = {k for keys in self.send_plan.values() for k in keys}
        self.freeable: frozenset[ValueKey] = frozenset()
        self.weights = [p for p in stage.parameters() if p.requires_grad]
        self.autocast_dtype: torch.dtype | None = None
        self.device = torch.device("cpu")
        self.loss_scale = 1.0
        self.loss_weight: float | None = None  # per micro-batch loss; None: 1 / micro-batches
        self.keep: str | None = None  # a model output the last stage keeps (predict)
        self.kept: list[torch.Tensor] = []
        # the last stage's loss computed eagerly from the split's output (`attach_loss`)
        self.output_loss: OutputLoss | None = None
        self.losses: list[torch.Tensor] = []
        self.state: list[MicroBatchState] = []
        self.microbatches: list[dict[str, torch.Tensor]] = []
        # what the last shape discovery found this stage receives, per micro-batch: value ->
        # (shape, dtype) (`memory_probe`)
        self.received_shapes: dict[int, dict[ValueKey, tuple[torch.Size, torch.dtype]]] = {}

    def begin(self, microbatches: list[dict[str, torch.Tensor]], num_microbatches: int) -> None:
        self.microbatches = microbatches
        self.state = [MicroBatchState() for _ in range(num_microbatches)]
        self.losses, self.kept = [], []

    def reset_microbatch(self, mb: int) -> None:
        """Forget what a pass over micro-batch `mb` left (shape discovery)."""
        if self.state:
            self._drop_outputs(self.state[mb])
            self.state[mb] = MicroBatchState()
        self.losses, self.kept = [], []

    def end(self) -> None:
        for state in self.state:
            self._drop_outputs(state)
        self.state, self.microbatches = [], []

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=self.autocast_dtype,
                              enabled=self.autocast_dtype is not None)

    # -- values in and out --------------------------------------------------------------------
    def receive(self, mb: int, values: dict[ValueKey, torch.Tensor]) -> None:
        self.state[mb].inputs.update(values)

    def outputs(self, mb: int) -> dict[ValueKey, torch.Tensor]:
        return self.state[mb].outputs

    def receive_grads(self, mb: int, grads: dict[ValueKey, torch.Tensor]) -> None:
        """Output gradients from one consumer stage; a value read by several sums them."""
        state = self.state[mb]
        for key, grad in grads.items():
            state.output_grads[key] = state.output_grads[key] + grad \
                if key in state.output_grads else grad

    def input_grads(self, mb: int) -> dict[ValueKey, torch.Tensor]:
        return self.state[mb].input_grads

    def sent(self, mb: int, kind_is_grad: bool, peer_stage: int | None = None) -> None:
        """The group that sent micro-batch `mb`'s gradients (or its activations, to
        `peer_stage`) finished posting: drop them, or free the data of the `freeable`."""
        state = self.state[mb]
        if kind_is_grad:
            state.input_grads = {}
        elif not torch.is_grad_enabled():
            self._drop_outputs(state)
        elif self.freeable:
            state.unsent.discard(peer_stage)
            pending = {k for stage in state.unsent for k in self.send_plan[stage]}
            for key in self.freeable - pending:
                self._free_data(state, key)

    def _free_data(self, state: MicroBatchState, key: ValueKey) -> None:
        """Free a sent output's data (the send holds its own reference until it ends). Its
        shape stays, on a one-element stride-0 storage, so its backward checks the received
        gradient against it; its autograd graph needs only what the graph saved. A value not
        needing a gradient is just dropped; a view is left (its base holds the memory)."""
        value = state.outputs.get(key)
        if value is None or value._base is not None or value.untyped_storage().nbytes() <= \
                value.element_size():
            return
        if value.requires_grad:
            value.data = torch.empty((), dtype=value.dtype, device=value.device).expand(
                value.shape)
        else:
            del state.outputs[key]
        if self.meter is not None:
            self.meter.release(state.output_tokens.pop(key, None))

    def _drop_outputs(self, state: MicroBatchState) -> None:
        if self.meter is not None:
            for token in state.output_tokens.values():
                self.meter.release(token)
        state.outputs, state.output_tokens = {}, {}

    # -- compute ------------------------------------------------------------------------------
    def load(self, mb: int) -> None:
        self.state[mb].inputs.update({(name, -1): tensor for name, tensor in
                                      self.microbatches[mb].items() if name in self.read_keys})

    def attach_loss(self, loss: OutputLoss) -> None:
        """Compute the last stage's loss eagerly: ``loss(output, inputs)`` from the split's
        output and the micro-batch's batch values named in ``loss.input_names``."""
        if not self.is_last:
            raise ValueError(f"stage {self.stage_id} is not the last: it computes no loss")
        self.output_loss = loss
        self.batch_keys = list(dict.fromkeys([*self.batch_keys, *loss.input_names]))

    def forward(self, mb: int, with_loss: bool = True) -> None:
        """`with_loss` False (shape discovery): the last stage leaves its loss uncomputed."""
        state = self.state[mb]
        recording = self.meter.recording() if self.meter is not None else contextlib.nullcontext()
        self.recompute.begin_forward(mb)
        try:
            with self._autocast(), recording:
                values = self.stage(state.inputs)
        finally:
            self.recompute.end_forward()
        if self.is_last and with_loss:
            state.loss = values[self.split.output_key]
            if self.output_loss is not None:
                state.loss = self.output_loss(state.loss, self.microbatches[mb])
            if state.loss.numel() != 1:
                raise ValueError(f"the split's output {self.split.output!r} must be a scalar "
                                 f"loss, got shape {tuple(state.loss.shape)}")
            self.losses.append(state.loss.detach())
            if self.keep is not None:
                key = (self.keep, self.split.output_key[1])
                if key not in values:
                    raise KeyError(f"the model has no output {self.keep!r} to keep; it returns "
                                   f"{sorted(k[0] for k in values)}")
                self.kept.append(values[key].detach())
        state.outputs = {k: values[k] for k in self.sent_keys}
        if not torch.is_grad_enabled():  # evaluation: nothing waits for a backward
            state.inputs = {}
            return
        state.unsent = set(self.send_plan)
        if self.meter is not None:  # kept until the backward (or freed once sent)
            state.output_tokens = {k: self.meter.hold(v) for k, v in state.outputs.items()}

    def _roots(self, state: MicroBatchState) -> tuple[list[torch.Tensor], list]:
        """What the backward starts from: the scaled loss, or the outputs and their grads."""
        if state.loss is not None:
            weight = self.loss_weight if self.loss_weight is not None else 1 / len(self.state)
            return [state.loss * (self.loss_scale * weight)], [None]
        keys = list(state.output_grads)
        return [state.outputs[k] for k in keys], [state.output_grads[k] for k in keys]

    def _grad_inputs(self, state: MicroBatchState) -> dict[ValueKey, torch.Tensor]:
        return {key: value for key, value in state.inputs.items()
                if key[1] >= 0 and value.requires_grad}

    def recompute_blocks(self, mb: int) -> None:
        self.recompute.recompute(mb, self._autocast())

    def backward(self, mb: int) -> None:
        state = self.state[mb]
        roots, grads = self._roots(state)
        if roots:
            torch.autograd.backward(roots, grads)
        state.input_grads = {key: (value.grad if value.grad is not None
                                   else torch.zeros_like(value))
                             for key, value in self._grad_inputs(state).items()}
        self._free(mb)

    def backward_input(self, mb: int) -> None:
        state = self.state[mb]
        roots, grads = self._roots(state)
        inputs = self._grad_inputs(state)
        dinputs, state.weight_grads = backward_input(roots, grads, list(inputs.values()),
                                                     self.weights)
        state.input_grads = dict(zip(inputs, dinputs))
        self._drop_outputs(state)
        state.output_grads, state.loss = {}, None

    def backward_weight(self, mb: int) -> None:
        backward_weight(self.state[mb].weight_grads, self.weights)
        self._free(mb)

    def _free(self, mb: int) -> None:
        state = self.state[mb]
        self._drop_outputs(state)
        state.inputs, state.output_grads, state.loss = {}, {}, None
        state.weight_grads = None
        self.recompute.release(mb)
