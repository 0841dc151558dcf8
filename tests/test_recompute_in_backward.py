"""`recompute_in_backward` (merak/recompute/blocks.py): each recomputed block rerun inside the
backward, one at a time, gives the gradients of the plain model, and the activation meter's peak
holds one recomputed block instead of all of them (what lets a long-sequence layout fit:
docs/context-parallel.md). Single process; the multi-rank run is test_context_parallel_trainer's
``cp-dp1tp1pp2cp2-ring-recompute-in-backward``."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from merak.recompute.blocks import BlockRecomputation
from merak.recompute.meter import ActivationMeter

LAYERS = 4
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2)


def _run(in_backward: bool | None):
    """Loss, gradients and activation peak of one step; None: without recomputation."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIG))
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    meter = ActivationMeter([*model.parameters(), *model.buffers()])
    segments = [[i] for i in range(LAYERS)] if in_backward is not None else []
    recompute = BlockRecomputation(list(model.model.layers), segments, torch.device("cpu"),
                                   meter=meter, in_backward=bool(in_backward))
    recompute.begin_forward(0)
    with meter.recording():
        loss = model(input_ids=ids, labels=ids).loss
    recompute.end_forward()
    if in_backward is not None:
        recompute.recompute(0)
    loss.backward()
    recompute.release(0)
    recompute.remove()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, meter.peak, meter.live


def test_recomputation_in_the_backward_gives_the_plain_gradients_in_less_memory():
    loss, grads, plain_peak, _ = _run(None)
    ahead_loss, ahead, ahead_peak, _ = _run(False)
    inside_loss, inside, inside_peak, live = _run(True)
    assert loss == ahead_loss == inside_loss
    for name, grad in grads.items():
        torch.testing.assert_close(inside[name], grad, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(ahead[name], grad, rtol=0, atol=0, msg=name)
    assert live == 0  # every kept input and recomputed tensor released
    # the recompute action brings every block back at once (the plain peak); the backward
    # holds the kept inputs and one block
    assert ahead_peak >= plain_peak
    assert inside_peak < 0.6 * plain_peak, (inside_peak, plain_peak)


def test_in_backward_needs_blocks_of_their_own():
    with pytest.raises(ValueError, match="segments of one block"):
        BlockRecomputation([torch.nn.Linear(2, 2)] * 2, [[0, 1]], torch.device("cpu"),
                           in_backward=True)
