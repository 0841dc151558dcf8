"""The main job: a small Hugging Face Llama trained by `MerakTrainer` with 3D parallelism
(dp x tp x pp) on CPU.

    torchrun --nproc_per_node 8 examples/train_llama_3d.py --dp 2 --tp 2 --pp 2

The script is an ordinary HF `Trainer` script plus three lines (`merak.init`,
`init_empty_weights`, `MerakArguments`/`MerakTrainer`). The model is built from a config on the
meta device; the trainer applies tensor parallelism (vocab-parallel embedding and LM head),
splits it into pipeline stages and materializes only this rank's shard. It trains on the Python
standard library's own source (byte-level tokens, nothing downloaded) and logs loss, grad norm,
learning rate and tokens/s every step on rank 0, then evaluates on held-out windows.
"""

from __future__ import annotations

import argparse

from transformers import AutoModelForCausalLM, LlamaConfig

import merak
from merak import MerakArguments, MerakTrainer, init_empty_weights
from merak.checkpoint.io import complete_checkpoints, read_layout
from merak.data.text import ByteWindows, stdlib_source_bytes
from merak.runtime.cpu_threads import threads_per_rank


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=sorted(merak.SCHEDULES))
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/main_job")
    parser.add_argument("--save-steps", type=int, default=0,
                        help="save a checkpoint every this many steps (0: none)")
    parser.add_argument("--save-async", action="store_true",
                        help="write checkpoints in the background")
    parser.add_argument("--resume", action="store_true",
                        help="resume from the newest complete checkpoint in --out, whatever "
                             "layout and world size wrote it (the global batch is kept)")
    return parser.parse_args()


def main() -> None:
    cli = parse_args()
    import torch

    torch.set_num_threads(threads_per_rank())
    ctx = merak.init(dp=cli.dp, tp=cli.tp, pp=cli.pp)

    config = LlamaConfig(vocab_size=256, hidden_size=cli.hidden,
                         intermediate_size=2 * cli.hidden, num_hidden_layers=cli.layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=cli.seq_len)
    torch.manual_seed(cli.seed)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)

    text = stdlib_source_bytes()
    global_batch = cli.micro_batch_size * cli.microbatches * cli.dp
    if cli.resume:  # the rows the run trained on: its checkpoint's global batch, whatever dp is now
        saved = complete_checkpoints(cli.out)
        if saved:
            global_batch = read_layout(saved[-1]).global_batch or global_batch
    train = ByteWindows(text, cli.seq_len, cli.steps * global_batch, seed=cli.seed)
    held_out = ByteWindows(text, cli.seq_len, 2 * global_batch, seed=cli.seed + 1)
    args = MerakArguments(
        output_dir=cli.out, max_steps=cli.steps, learning_rate=cli.lr, warmup_steps=3,
        per_device_train_batch_size=cli.micro_batch_size,
        per_device_eval_batch_size=cli.micro_batch_size,
        gradient_accumulation_steps=cli.microbatches, logging_steps=1, seed=cli.seed,
        train_schedule=cli.schedule, parallel_vocab=True,
        sequence_parallel=cli.sequence_parallel, disable_tqdm=True, report_to="none",
        save_strategy="steps" if cli.save_steps else "no", save_steps=cli.save_steps or 500,
        save_total_limit=2, save_async=cli.save_async)
    trainer = MerakTrainer(model=model, args=args, train_dataset=train, eval_dataset=held_out)
    result = trainer.train(resume_from_checkpoint=cli.resume or None)  # True: the newest
    metrics = trainer.evaluate()
    if ctx.rank == 0:
        logs = [h for h in trainer.state.log_history if "loss" in h]
        speed = sum(h["tokens_per_second"] for h in logs[1:]) / max(len(logs) - 1, 1)
        print(f"{ctx.describe()}\n{trainer.stage.split.describe()}")
        print(f"done: loss {logs[0]['loss']:.4f} -> {logs[-1]['loss']:.4f}, eval loss "
              f"{metrics['eval_loss']:.4f}, {speed:.0f} tokens/s after the first step, "
              f"{result.metrics['train_runtime']:.1f} s")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
