"""One rank of a small MerakTrainer job (a tiny Llama, dp x pp, evaluation and saves every few
steps) in which one rank stops (SIGSTOP) or dies (SIGKILL) at a chosen point of a chosen step:
forward, backward, the step tail (the dp all-reduce, the optimizer step), evaluation or a save.
Launched by `fault_harness.launch` (tests/test_faults.py, bench/fault_sweep.py), not by the
pooled suite: each rank writes ``fault.json`` when it injects the fault, and every rank's exit
time and output are the harness's to judge.

    FAULT=rank:point:step:kind   e.g. 2:backward:3:stop
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import transformers as tf

import merak
from merak.distributed.timeouts import set_job_timeout
from merak.runtime.hooks import InstructionHook

POINTS = ("forward", "backward", "reduce_grads", "optimizer_step", "evaluation", "save")


def _inject(out: Path, rank: int, point: str, step: int, kind: str) -> None:
    (out / "fault.json").write_text(json.dumps({"rank": rank, "point": point, "step": step,
                                                "kind": kind, "time": time.time()}))
    os.kill(os.getpid(), signal.SIGSTOP if kind == "stop" else signal.SIGKILL)


class _At(InstructionHook):
    """Injects the fault when this rank begins `point` (an instruction) of `step`."""

    def __init__(self, fault):
        self.fault, self.step = fault, 0

    def on_step_begin(self, step: int) -> None:
        self.step = step + 1

    def on_instruction_begin(self, name: str, action) -> None:
        if name == self.fault[2] and self.step == self.fault[3]:
            _inject(*self.fault)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=10)
    args = parser.parse_args()
    out, rank = Path(args.out), int(os.environ["RANK"])
    fault_rank, point, step, kind = os.environ["FAULT"].split(":")
    mine = int(fault_rank) == rank
    fault = (out, rank, point, int(step), kind)
    torch.set_num_threads(1)
    # the order a script may use: the arguments (ddp_timeout) first, then merak.init
    fields = dict(output_dir=str(out / "run"), use_cpu=True, report_to="none", max_steps=8,
                  per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  learning_rate=1e-3, logging_steps=1, ddp_timeout=args.timeout,
                  eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2,
                  save_strategy="steps", save_steps=3, disable_tqdm=True, seed=1)
    training = merak.MerakArguments(**fields)
    merak.init(dp=args.dp, tp=1, pp=args.pp, timeout=args.timeout)
    with merak.init_empty_weights():
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=0, eos_token_id=0, pad_token_id=0))
    rows = [{"input_ids": torch.randint(0, 512, (16,)), "labels": torch.randint(0, 512, (16,))}
            for _ in range(64)]

    class Faulty(merak.MerakTrainer):
        def _assemble(self, example):
            first = self.engine is None
            super()._assemble(example)
            if first and mine and point in ("forward", "backward", "reduce_grads",
                                            "optimizer_step"):
                self.engine.interpreter.hooks.append(_At(fault))

        def _merak_eval_loop(self, dataset, prefix, predictions=False):
            if mine and point == "evaluation" and self.state.global_step >= fault[3]:
                original = self.engine.interpreter.eval_step

                def eval_step(*a, **k):  # inside evaluation: the peers wait in its transfers
                    _inject(*fault)
                    return original(*a, **k)
                self.engine.interpreter.eval_step = eval_step
            return super()._merak_eval_loop(dataset, prefix, predictions)

        def _save_merak_checkpoint(self):
            if mine and point == "save" and self.state.global_step >= fault[3]:
                _inject(*fault)
            return super()._save_merak_checkpoint()

    class AtStepBegin(merak.TrainerCallback if hasattr(merak, "TrainerCallback")
                      else __import__("transformers").TrainerCallback):
        """Before the step's first collective (its token count over the dp group)."""

        def on_step_begin(self, args, state, control, **kwargs):
            if mine and point == "step_begin" and state.global_step + 1 == fault[3]:
                _inject(*fault)

    trainer = Faulty(model=model, args=training, train_dataset=rows, eval_dataset=rows[:8],
                     callbacks=[AtStepBegin()])
    # the build (each rank traces the model) under a long timeout, so that a loaded host's
    # skew between ranks is not taken for a fault; the job's timeout from the first step on
    set_job_timeout(600)
    trainer._assemble(trainer._example(rows, training.per_device_train_batch_size))
    set_job_timeout(args.timeout)
    trainer.train()
    print(f"rank {rank}: training finished", flush=True)


if __name__ == "__main__":
    main()
