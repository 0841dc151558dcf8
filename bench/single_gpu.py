"""One GPU: MerakTrainer (dp = tp = pp = 1) against HF Trainer on the same HF Llama, batch and
sequence length, in bf16: tokens/s, MFU and peak memory, Merak's as ratios to HF's.

    torchrun --nproc_per_node 1 bench/single_gpu.py            # a Llama of about 1.1 B
    torchrun --nproc_per_node 1 bench/single_gpu.py --tiny      # a smoke run (CPU too)
    torchrun --nproc_per_node 1 bench/single_gpu.py --fp8 tensorwise  # and MerakTrainer in fp8

Target: Merak >= 1.0x HF Trainer's tokens/s and MFU >= 45% on an H100/H200.
Both trainers run the same steps on the same random token windows, one after the other in this
process; the first `--warmup` steps are not timed. A step's time is measured between the ends
of consecutive optimizer steps, after a device synchronisation. MFU counts the model's FLOPs
per token as 6 x parameters + 12 x layers x hidden x sequence (attention scores), over
`--peak-tflops` (default: 989 dense bf16 TFLOP/s for H100 and H200).

Not measured: pp=2 with both stages on the one GPU. Each pipeline rank is a process and NCCL
refuses two ranks on one GPU, so two stages need two GPUs (or gloo, which is not a GPU path).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
from _common import RESULTS
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import merak
from merak import MerakArguments, MerakTrainer

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide Llama")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile N steps after the warm-up with torch.profiler and print "
                             "each trainer's busiest kernels and the device's busy time a step")
    parser.add_argument("--fp8", choices=("tensorwise", "rowwise"), default=None,
                        help="also run MerakTrainer with fp8=this (torchao's float8 linears; "
                             "emulated without an fp8 GPU): 'merak-fp8'")
    parser.add_argument("--out", default=str(RESULTS / "single_gpu.json"))
    return parser.parse_args()


def llama_config(cli) -> LlamaConfig:
    if cli.tiny:
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=cli.seq_len)
    # TinyLlama-1.1B's shape
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                       num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                       max_position_embeddings=cli.seq_len)


class RandomWindows(torch.utils.data.Dataset):
    def __init__(self, count: int, seq_len: int, vocab: int):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (count, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class StepClock(TrainerCallback):
    """The wall time of each optimizer step after the warm-up, the device synchronised; with
    `profile`, torch.profiler over that many steps after the warm-up."""

    def __init__(self, warmup: int, profile: int = 0):
        self.warmup, self.times, self._last = warmup, [], None
        self.profile, self.profiler = profile, None

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        if state.global_step > self.warmup and self._last is not None:
            self.times.append(now - self._last)
        if self.profile and state.global_step == self.warmup:
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        elif self.profiler is not None and state.global_step == self.warmup + self.profile:
            self.profiler.__exit__(None, None, None)
        self._last = now

    def report(self, name: str) -> None:
        if self.profiler is None:
            return
        kernels = [e for e in self.profiler.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1e3 / self.profile
        events = self.profiler.key_averages()
        print(f"{name}: the device was busy {busy:.1f} ms a step (profiled {self.profile} steps)")
        print(events.table(sort_by="self_device_time_total", row_limit=12,
                           max_name_column_width=60))


def run(name: str, cli, config: LlamaConfig, device: torch.device) -> dict:
    torch.manual_seed(0)
    common = dict(output_dir=f"runs/single_gpu-{name}", max_steps=cli.steps,
                  per_device_train_batch_size=cli.batch,
                  gradient_accumulation_steps=cli.accumulation, learning_rate=1e-4,
                  logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                  bf16=device.type == "cuda", use_cpu=device.type == "cpu", seed=0)
    data = RandomWindows(cli.steps * cli.batch * cli.accumulation, cli.seq_len,
                         config.vocab_size)
    clock = StepClock(cli.warmup, cli.profile)
    if name == "hf":
        model = AutoModelForCausalLM.from_config(config)
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=data,
                          callbacks=[clock])
    else:
        with merak.init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
        fp8 = cli.fp8 if name == "merak-fp8" else None
        trainer = MerakTrainer(model=model, args=MerakArguments(**common, fp8=fp8),
                               train_dataset=data, callbacks=[clock])
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    clock.report(name)
    params = sum(p.numel() for p in model.parameters())
    step_s = sorted(clock.times)[len(clock.times) // 2] if clock.times else float("nan")
    tokens = cli.batch * cli.accumulation * cli.seq_len
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    del trainer, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"step_s": step_s, "tokens_per_s": tokens / step_s, "peak_bytes": peak,
            "params": params, "losses": losses}


def main() -> None:
    cli = parse_args()
    ctx = merak.init(dp=1, tp=1, pp=1)  # NCCL on a GPU, gloo on CPU
    device, config = ctx.device, llama_config(cli)
    peak_tflops = cli.peak_tflops
    if peak_tflops is None and device.type == "cuda":
        name = torch.cuda.get_device_name()
        peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    names = ("hf", "merak", *(("merak-fp8",) if cli.fp8 else ()))
    results = {name: run(name, cli, config, device) for name in names}
    matmul_params = results["hf"]["params"] - config.vocab_size * config.hidden_size  # not the
    per_token = 6 * matmul_params + 12 * config.num_hidden_layers \
        * config.hidden_size * cli.seq_len  # input embedding: a lookup, no FLOPs
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}: Llama "
          f"{results['hf']['params'] / 1e9:.2f} B, seq {cli.seq_len}, "
          f"{cli.batch} x {cli.accumulation} rows per step")
    print(f"{'':10}{'tokens/s':>12}{'MFU':>8}{'peak GiB':>10}{'last loss':>11}")
    for name, r in results.items():
        r["mfu"] = per_token * r["tokens_per_s"] / (peak_tflops * 1e12) if peak_tflops else None
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        peak = f"{r['peak_bytes'] / 2**30:.1f}" if r["peak_bytes"] else "n/a"
        last = f"{r['losses'][-1]:.4f}" if r["losses"] else "n/a"
        print(f"{name:10}{r['tokens_per_s']:12.0f}{mfu:>8}{peak:>10}{last:>11}")
    ratio = results["merak"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    print(f"merak / HF tokens/s: {ratio:.3f} (target >= 1.0)")
    if cli.fp8:
        fp8_ratio = results["merak-fp8"]["tokens_per_s"] / results["merak"]["tokens_per_s"]
        print(f"merak fp8 ({cli.fp8}) / merak tokens/s: {fp8_ratio:.3f}")
    if results["merak"]["mfu"] is not None:
        print(f"merak MFU: {results['merak']['mfu']:.1%} (target >= 45%)")
    if results["hf"]["peak_bytes"]:
        print(f"merak / HF peak memory: "
              f"{results['merak']['peak_bytes'] / results['hf']['peak_bytes']:.3f}")
    Path(cli.out).parent.mkdir(parents=True, exist_ok=True)
    with open(cli.out, "w") as handle:
        json.dump({"config": vars(cli), "results": results, "tokens_per_s_ratio": ratio},
                  handle, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
