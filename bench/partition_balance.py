"""Stage balance of the partition methods on a model whose pieces cost unequal time.

    .venv/bin/python bench/partition_balance.py

A Llama with 24 small layers and a large vocabulary (its LM head and loss cost about four layers) is
split into 4 stages with `uniform`, `parameters` and `profile`. Each stage graph is then timed
on its own (forward + backward on the inputs it really receives) and the bench prints
slowest-stage time / mean stage time per method (target for `profile`: <= 1.10).
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from merak.partition.auto import auto_split

NUM_STAGES = 4


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=14336, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=24, num_attention_heads=4, num_key_value_heads=4,
                         tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config)


def stage_times(split, inputs: dict, repeats: int = 5) -> list[float]:
    """Median forward+backward seconds of each stage graph on its real inputs."""
    carry: dict = {}
    times = []
    for s in range(split.num_stages):
        graph, piece = split.stage_graph(s), split.pieces[s]
        args = [carry[n].detach().requires_grad_(carry[n].is_floating_point())
                if n in carry else inputs[n] for n in piece.inputs]
        samples = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            out = graph(*args)
            roots = [out["loss"]] if "loss" in out else [v for v in out.values()
                                                         if v.requires_grad]
            torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
            samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples[1:]))
        carry = {k: v.detach() for k, v in out.items()}
    return times


def main() -> None:
    torch.set_num_threads(1)
    model = build()
    ids = torch.randint(0, 14336, (4, 128))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    print(f"Llama, 24 layers, hidden 256, vocab 14336, {NUM_STAGES} stages, batch 4 x 128")
    print(f"{'method':<12} {'blocks per stage':<18} {'stage ms':<30} slowest/mean")
    for method in ("uniform", "parameters", "profile"):
        split = auto_split(model, inputs, NUM_STAGES, partition_method=method)
        times = stage_times(split, inputs)
        ratio = max(times) / statistics.mean(times)
        counts = [len(b) for b in split.blocks_of_stage]
        print(f"{method:<12} {counts!s:<18} {[round(t * 1e3) for t in times]!s:<30} "
              f"{ratio:.2f}" + ("   (target <= 1.10)" if method == "profile" else ""))
        model.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
