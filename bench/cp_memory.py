"""Activation memory per rank under context parallelism (issue 36): cp=2 against cp=1 for the
same micro-batch, by the engine's activation meter.

    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 bench/cp_memory.py

On 2 ranks, a Llama of 4 blocks (hidden 256, 8 heads, 4 key/value heads, vocabulary 4096) is
built by `merak.parallelize` and run by the interpreter with ``measure_activations`` (the bytes
a step's forwards keep for backward, at their peak: the activation meter of
`merak.recompute.meter`, the planner's dry runs' figure on CPU). One micro-batch of 1 row of
`--seq` tokens: with cp=1 (``merak.init(dp=2)``) each rank holds the whole row; with cp=2 each
holds its load-balanced half, the attention wrapped as Ulysses or ring around sdpa and eager.
Printed: each run's peak on rank 0 and its ratio to cp=1's with the same attention; target
<= 0.55.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import transformers as tf

import merak
from merak.context_parallel import enable_context_parallel, split_batch

CONFIG = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
          "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4}
TARGET = 0.55


def peak_bytes(config, inner: str, seq: int, cp: int, mode: str | None) -> int:
    """The activation peak of one training step of one micro-batch on this rank."""
    ctx = merak.init(dp=2 // cp, tp=1, pp=1, cp=cp)
    torch.manual_seed(0)
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                    attn_implementation=inner)
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids,
             "num_items_in_batch": torch.tensor([seq - 1])}
    if cp > 1:
        enable_context_parallel(model, ctx.cp_group, mode)
        batch = split_batch(batch, cp, ctx.cp_rank)
    stage = merak.parallelize(model, batch, ctx)
    engine = merak.PipelineInterpreter(stage, ctx, torch.optim.SGD(stage.parameters(), lr=0.0),
                                       1, measure_activations=True)
    engine.loss_weight = 1.0  # the model divides by the row's token count
    engine.train_step(batch)
    return engine.activation_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=2048)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) != 2:
        raise SystemExit("run under torchrun --nproc_per_node 2")
    config = tf.LlamaConfig(**CONFIG)
    rows = []
    for inner in ("sdpa", "eager"):
        whole = peak_bytes(config, inner, cli.seq, 1, None)
        rows.append((inner, "cp=1", whole, 1.0))
        for mode in ("ulysses", "ring"):
            half = peak_bytes(config, inner, cli.seq, 2, mode)
            rows.append((inner, f"cp=2 {mode}", half, half / whole))
    if torch.distributed.get_rank() == 0:
        print(f"activation peak per rank, one micro-batch of 1 x {cli.seq} tokens, Llama "
              f"{CONFIG['num_hidden_layers']} blocks x hidden {CONFIG['hidden_size']}")
        print(f"{'attention':10}{'layout':16}{'MiB':>10}{'vs cp=1':>10}")
        for inner, layout, peak, ratio in rows:
            print(f"{inner:10}{layout:16}{peak / 2**20:10.1f}{ratio:10.3f}")
        worst = max(r for _, layout, _, r in rows if layout != "cp=1")
        print(f"largest cp=2 ratio {worst:.3f} (target <= {TARGET}): "
              f"{'met' if worst <= TARGET else 'NOT met'}")


if __name__ == "__main__":
    main()
