"""MerakTrainer's parts in one process: NEFTune's noise hook, HF's label-smoothed loss, the
fp16 unscale, a `loss_fn` in place of the model's loss, the TP plan handed to `parallelize`."""

from __future__ import annotations

import pytest
import torch
from trainer_common import (
    build,
)

from merak import MerakArguments


def test_neftune_hook_noise_is_keyed_by_step_microbatch_and_dp_rank():
    """The noise of `merak.trainer.neftune`: HF's magnitude; the same for the same key (a
    recompute of the micro-batch), another for another dp rank, step or micro-batch; none in
    eval mode or without gradients."""
    import math

    import torch

    from merak.schedule.actions import Action, ActionKind
    from merak.trainer.neftune import NEFTune

    def noise(dp_rank=0, step=0, mb=0, kind=ActionKind.FORWARD, train=True, grad=True):
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(10, 8).train(train)
        hook = NEFTune(5.0, 42, dp_rank, lambda: step)
        assert hook.attach(embedding, embedding)
        hook.on_instruction_begin(kind.value, Action(kind, 0, mb))
        ids = torch.arange(6).view(2, 3)
        with torch.set_grad_enabled(grad):
            return (embedding(ids) - torch.nn.functional.embedding(ids, embedding.weight)).detach()

    first = noise()
    bound = 5.0 / math.sqrt(3 * 8)
    assert 0 < first.abs().max() <= bound and first.abs().max() > bound / 2
    assert torch.equal(first, noise(kind=ActionKind.RECOMPUTE))
    for other in ({"dp_rank": 1}, {"step": 1}, {"mb": 1}):
        assert not torch.equal(first, noise(**other)), other
    assert not noise(train=False).any() and not noise(grad=False).any()


def test_label_smoothed_loss_equals_hf_label_smoother():
    import torch
    from transformers import GPT2ForSequenceClassification, LlamaConfig, LlamaForCausalLM
    from transformers.trainer_pt_utils import LabelSmoother

    from merak.trainer.losses import LabelSmoothedLoss, shifts_labels

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=generator)
    labels = torch.randint(0, 11, (3, 7), generator=generator)
    labels[0, 2:5] = -100
    for shift in (True, False):
        expected = LabelSmoother(epsilon=0.1)({"logits": logits}, labels, shift_labels=shift)
        ours = LabelSmoothedLoss(0.1, shift_labels=shift)({"logits": logits}, labels)
        assert ours.item() == pytest.approx(expected.item(), rel=1e-6)
    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=2)
    assert shifts_labels(LlamaForCausalLM(config))
    assert not shifts_labels(GPT2ForSequenceClassification.__new__(
        GPT2ForSequenceClassification))


@pytest.mark.parametrize("scale", [2.0 ** 12, 3.0])
def test_fused_unscale_matches_dividing_each_gradient_and_finds_overflow(scale):
    """The fp16 scaler's fused unscale-and-check (one kernel per device and dtype, no host
    sync per gradient) gives what dividing each gradient and testing it gave, and flags an inf
    or nan in any one of them."""
    from merak.engine.loss_scale import unscale_and_check

    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(shape, generator=g) * scale for shape in ((7, 5), (13,), (2, 3, 4))]
    grads.append(torch.randn(6, generator=g).to(torch.bfloat16) * scale)  # another dtype group
    expected = [x / scale for x in grads]
    found = unscale_and_check(grads, scale, torch.device("cpu"))
    assert found.item() == 0.0
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-6 if got.dtype == torch.float32 else 1e-2,
                                   atol=0)
    for bad in (float("inf"), float("nan")):
        grads = [torch.ones(4), torch.ones(3, dtype=torch.bfloat16)]
        grads[1][2] = bad
        assert unscale_and_check(grads, scale, torch.device("cpu")).item() == 1.0


def test_loss_fn_replaces_the_models_own_loss():
    """One process (dp = tp = pp = 1): a custom loss_fn is what the trainer minimizes."""
    from transformers import default_data_collator

    import merak
    from merak.trainer.model_setup import default_loss_fn

    merak.init(dp=1, tp=1, pp=1)
    with merak.init_empty_weights():
        model = build("llama")
    doubled = lambda outputs, labels: 2 * default_loss_fn(outputs, labels)
    args = MerakArguments(output_dir="out", max_steps=1, per_device_train_batch_size=4,
                          report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no",
                          train_sampling_strategy="sequential")
    from trainer_common import train_set

    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set(),
                                 loss_fn=doubled)
    trainer.train()
    reference = build("llama")
    batch = default_data_collator(train_set()[:4])
    expected = 2 * default_loss_fn(reference(input_ids=batch["input_ids"]), batch["labels"])
    assert trainer.state.log_history[0]["loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert expected.item() == pytest.approx(2 * reference(**batch).loss.item(), rel=1e-5)


def test_an_explicit_tp_plan_reaches_parallelize(monkeypatch):
    """MerakArguments(tp_plan=dict) becomes a TPPlan, which MerakTrainer hands to
    parallelize over the one set_tp_layer_lists recorded."""
    import torch
    from trainer_common import train_set

    import merak
    import merak.engine.assemble as assemble_module
    from merak.tensor_parallel.plans.tp_plan import clear_registered_plan

    merak.init(dp=1, tp=1, pp=1)
    try:
        merak.set_tp_layer_lists(col_para_list=["registered"])
        args = MerakArguments(output_dir="out", max_steps=1, report_to="none", use_cpu=True,
                              tp_plan={"col_para_list": ["mlp.up_proj"],
                                       "row_para_list": ["mlp.down_proj"]})
        assert isinstance(args.tp_plan, merak.TPPlan)
        assert args.tp_plan.column == ("mlp.up_proj",)
        seen = {}

        def fake_parallelize(model, example, ctx, **options):
            seen.update(options)
            raise InterruptedError

        monkeypatch.setattr(assemble_module, "parallelize", fake_parallelize)
        with merak.init_empty_weights():
            model = build("llama")
        trainer = merak.MerakTrainer(model=model, args=args, train_dataset=train_set())
        ids = torch.zeros(2, 8, dtype=torch.long)
        with pytest.raises(InterruptedError):
            trainer._assemble({"input_ids": ids, "labels": ids})
        assert seen["tensor_parallel"].plan is args.tp_plan
    finally:
        clear_registered_plan()
