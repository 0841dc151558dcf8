"""Interleaved 1F1B (2 chunks per rank) trains an auto-split HF model exactly like the
single-process model: losses, every gradient, final weights, and the eval loss (see
test_interleaved)."""

from __future__ import annotations

import os

import torch
import transformers as tf
from common import (
    GradSnapshot,
    assert_close,
    assert_trained_like,
    family_scenarios,
    run_scenarios,
    train_reference,
)
from hf_models import LLAMA_LIKE, VOCAB, batch

import merak
from merak.pipeline.interleaved_runtime import InterleavedInterpreter

STEPS, ROWS, LR, SEED, CHUNKS = 3, 2, 0.05, 1234, 2
FAMILY_NAMES = ("llama", "gpt2")
VARIANTS = {"interleaved": {}, "interleaved-recompute": {"recompute_ratio": 1.0}}


def make_model(family: str, num_layers: int):
    if family == "llama":
        config = tf.LlamaConfig(vocab_size=VOCAB, num_hidden_layers=num_layers, **LLAMA_LIKE)
    else:  # GPT-2 ties its embedding (chunk 0 of rank 0) and head (last chunk of the last rank)
        config = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=num_layers, n_head=4,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                               eos_token_id=0)
    return tf.AutoModelForCausalLM.from_config(config)


def scenario_names(world_size: int) -> list[str]:
    return [f"{family}-pp{world_size}-{variant}" for family in FAMILY_NAMES
            for variant in VARIANTS]


class _Family:
    """One family's chunks, initial weights and single-process reference, built once."""

    def __init__(self, family: str, pp: int):
        self.family, self.ctx = family, merak.init(dp=1, tp=1, pp=pp)
        self.microbatches, num_layers = 2 * pp, pp * CHUNKS  # one block per virtual stage
        torch.manual_seed(SEED)
        with merak.init_empty_weights():
            model = make_model(family, num_layers)
        self.stage = merak.parallelize(model, batch(family, 0, ROWS), self.ctx,
                                       num_model_chunks=CHUNKS)
        self.initial = {k: v.clone() for k, v in self.stage.state_dict().items()}
        torch.manual_seed(SEED)
        reference = make_model(family, num_layers)
        self.losses, self.grads, self.final = train_reference(
            reference, [batch(family, step, ROWS * self.microbatches) for step in range(STEPS)],
            LR)
        reference.eval()
        with torch.no_grad():
            self.eval_loss = reference(**batch(family, 99, ROWS * self.microbatches)).loss.item()

    def check(self, variant: str) -> None:
        self.stage.load_state_dict(self.initial)
        snapshot = GradSnapshot(self.stage)
        engine = InterleavedInterpreter(
            self.stage, self.ctx, torch.optim.SGD(self.stage.parameters(), lr=LR),
            self.microbatches, hooks=[snapshot], p2p_timeout_s=120, **VARIANTS[variant])
        try:
            kinds = {a.kind.value for _, a in engine.program}
            assert ("recompute" in kinds) == ("recompute" in variant), f"{variant}: {kinds}"
            losses = [engine.train_step(batch(self.family, step, ROWS * self.microbatches))
                      for step in range(STEPS)]
            eval_loss = engine.eval_step(batch(self.family, 99, ROWS * self.microbatches))
        finally:
            for recompute in engine.recompute:
                recompute.remove()
        assert_trained_like(variant, losses, snapshot, self.stage, self.losses, self.grads,
                            self.final)
        assert_close(torch.tensor(eval_loss), torch.tensor(self.eval_loss), f"{variant}: eval")


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    run_scenarios(family_scenarios(lambda f: _Family(f, world), FAMILY_NAMES, VARIANTS, world))


if __name__ == "__main__":
    main()
