"""Our 1F1B against torch.distributed.pipelining.Schedule1F1B on the same split.

    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 bench/pipeline_vs_torch.py
    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 bench/pipeline_vs_torch.py \
        --hidden 64 --layers 2 --seq-len 16 --rounds 1 --steps-per-round 1   # a quick look

A GPT-2-style model (untied head, so both runtimes do the same work) is cut after its first half
of blocks into 2 stages (ours built by `build_engine`, bench/_common.py, with that custom
partition; torch's by hand); each runtime trains copies of it with AdamW on the same batches,
8 micro-batches per step. Rounds alternate between the two runtimes so machine noise hits both;
rank 0 prints the median tokens/s of each and the ratio ours / torch (target >= 1.05).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import build
from torch import nn
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import Schedule1F1B

import merak
from merak.models.gpt import GPT, GPTConfig


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps-per-round", type=int, default=3)
    return parser.parse_args()


class TorchStage0(nn.Module):
    def __init__(self, model: GPT, cut: int):
        super().__init__()
        self.embed, self.blocks = model.embed, model.blocks[:cut]

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        return hidden


class TorchStage1(nn.Module):
    def __init__(self, model: GPT, cut: int):
        super().__init__()
        self.blocks, self.ln_f, self.lm_head = (model.blocks[cut:], model.head.ln_f,
                                                model.head.lm_head)

    def forward(self, hidden):
        for block in self.blocks:
            hidden = block(hidden)
        return self.lm_head(self.ln_f(hidden))


def cross_entropy(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build_model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                         max_positions=args.seq_len, tie_word_embeddings=False))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    ctx = merak.init(dp=1, tp=1, pp=2)
    cut = args.layers // 2
    batch_size = args.micro_batch_size * args.microbatches
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (batch_size, args.seq_len + 1), generator=generator)
    batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}

    def build_ours(lend_idle_cores: bool):
        rows = {k: v[:args.micro_batch_size] for k, v in batch.items()}
        engine = build(build_model(args), rows, ctx,  # embed + first half | rest + head
                       lambda stage: torch.optim.AdamW(stage.parameters(), lr=1e-4),
                       num_microbatches=args.microbatches, schedule="1f1b",
                       partition_method="custom", custom_partition=(0, cut, args.layers),
                       lend_idle_cores=lend_idle_cores)
        return engine.interpreter

    ours, ours_plain = build_ours(True), build_ours(False)
    ours_batch = {k: batch[k] for k in ours.batch_keys}

    torch_model = build_model(args)
    module = TorchStage0(torch_model, cut) if ctx.pp_rank == 0 else TorchStage1(torch_model, cut)
    torch_stage = TorchStage(module, ctx.pp_rank, 2, ctx.device)
    torch_schedule = Schedule1F1B(torch_stage, args.microbatches, loss_fn=cross_entropy)
    torch_optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def step_ours():
        ours.train_step(ours_batch)

    def step_ours_plain():
        ours_plain.train_step(ours_batch)

    def step_torch():
        if ctx.pp_rank == 0:
            torch_schedule.step(batch["input_ids"])
        else:
            torch_schedule.step(target=batch["labels"])
        torch_optimizer.step()
        torch_optimizer.zero_grad(set_to_none=True)

    tokens = batch_size * args.seq_len
    variants = (("ours", step_ours), ("ours_plain", step_ours_plain), ("torch", step_torch))
    rates: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _, step in variants:  # warm-up (torch infers shapes on its first step)
        step()
        step()
    for _ in range(args.rounds):
        for name, step in variants:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps_per_round):
                step()
            dist.barrier()
            rates[name].append(tokens * args.steps_per_round / (time.perf_counter() - start))
    if ctx.rank == 0:
        ours_rate, plain_rate, torch_rate = (statistics.median(rates[name])
                                             for name, _ in variants)
        print(f"GPT-2-style: hidden {args.hidden}, {args.layers} layers, seq {args.seq_len}, "
              f"2 stages, {args.microbatches} micro-batches of {args.micro_batch_size}")
        print(f"merak 1f1b                      {ours_rate:8.0f} tokens/s")
        print(f"merak 1f1b without core lending {plain_rate:8.0f} tokens/s "
              f"(ratio to torch {plain_rate / torch_rate:.3f})")
        print(f"torch Schedule1F1B              {torch_rate:8.0f} tokens/s")
        print(f"ratio merak / torch             {ours_rate / torch_rate:8.3f}   (target >= 1.05)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
