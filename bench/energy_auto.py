"""``energy_mode="auto"`` on 4 gloo ranks with simulated GPUs: measured saving against the plan.

One torchrun launch (this file, `--worker`) trains a tiny GPT-2 with MerakTrainer and
``energy_mode="auto"`` for each schedule (1F1B, zero-bubble, interleaved 1F1B), until `--after`
steps into the deployed plan, and prints per schedule: the steps spent profiling, at max clocks
while the plan was computed, and planned; the plan's predicted saving and the saving measured
(median energy per step of the planned steps against the all-max steps of the same run); their
ratio (target >= 0.90); the step time change (target within ``energy_max_slowdown`` + 1%, i.e.
+2%). tests/test_energy_training.py runs auto mode with shorter instructions and asserts what
wall-clock noise cannot break, none of these figures (run this on an idle machine).

    python bench/energy_auto.py [--forward-s 0.1] [--after 10]
                                [--schedules 1f1b,zero_bubble,interleaved_1f1b]
    python bench/energy_auto.py --forward-s 0.02 --after 2 --schedules 1f1b   # a quick look
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _common import RESULTS, launch_self

MAX_SLOWDOWN = 0.01  # MerakArguments.energy_max_slowdown's default, which the runs keep
RANKS, MICROBATCHES, SEED, LIMIT, VOCAB, SEQ = 4, 4, 3, 250, 128, 16
KEYS = ("energy_saved", "energy_step_time_change", "energy_predicted_saved",
        "energy_predicted_time_change", "energy_profile_steps", "energy_plan_step")


def _run_schedule(schedule: str, cli, out: Path) -> dict:
    """Every rank: one auto-mode run of `schedule`, ended `cli.after` steps into its plan."""
    import torch
    import transformers as tf

    import merak

    class StopAfterThePlan(tf.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            auto = trainer.energy.auto
            if auto.plans and auto.phase == "planned" and \
                    state.global_step >= auto.plans[-1]["step"] + cli.after - 1:
                control.should_training_stop = True

    merak.init(dp=1, tp=1, pp=RANKS)
    torch.manual_seed(SEED)
    with merak.init_empty_weights():
        model = tf.AutoModelForCausalLM.from_config(tf.GPT2Config(
            n_embd=16, n_layer=8, n_head=2, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0))
    ids = torch.randint(2, VOCAB, (MICROBATCHES * LIMIT, SEQ),
                        generator=torch.Generator().manual_seed(SEED))
    chunks = {"num_model_chunks": 2} if schedule == "interleaved_1f1b" else {}
    args = merak.MerakArguments(
        output_dir=str(out / schedule), max_steps=LIMIT, per_device_train_batch_size=1,
        gradient_accumulation_steps=MICROBATCHES, learning_rate=1e-3,
        lr_scheduler_type="constant", logging_steps=1, seed=SEED, report_to="none",
        disable_tqdm=True, use_cpu=True, save_strategy="no", train_sampling_strategy="sequential",
        train_schedule=schedule, energy_mode="auto", energy_gpu="simulated",
        simulated_gpu=json.dumps({"forward_s": cli.forward_s, "clock_step": 90}), **chunks)
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=[
        {"input_ids": row, "labels": row.clone()} for row in ids])
    trainer.add_callback(StopAfterThePlan())
    output = trainer.train()
    auto = trainer.energy.auto
    if not auto.plans:
        raise RuntimeError(f"{schedule}: no plan deployed in {LIMIT} steps: {auto.events}")
    first, last = auto.plans[-1]["all_max_steps"]
    return {**{key: output.metrics[key] for key in KEYS}, "steps": trainer.state.global_step,
            "replans": len(auto.plans) - 1, "all_max_steps": last - first + 1}


def worker(cli) -> None:
    import torch.distributed as dist

    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in cli.schedules.split(","):
            report[schedule] = _run_schedule(schedule, cli, Path(tmp))
    if dist.get_rank() == 0:
        Path(cli.out).write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forward-s", type=float, default=0.1,
                        help="simulated forward of one micro-batch at the highest clock")
    parser.add_argument("--after", type=int, default=10, help="planned steps measured")
    parser.add_argument("--schedules", default="1f1b,zero_bubble,interleaved_1f1b")
    parser.add_argument("--save", default=str(RESULTS / "energy_auto.json"),
                        help="where the figures go (JSON; default %(default)s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    report, took = launch_self(__file__, RANKS)
    print(f"4 ranks, forward {args.forward_s * 1e3:.0f} ms at the highest clock, "
          f"energy_max_slowdown {MAX_SLOWDOWN:.0%}; {took:.0f} s")
    print(f"{'schedule':18}{'profile':>8}{'all-max':>8}{'planned':>8}{'predicted':>10}"
          f"{'measured':>10}{'ratio':>7}{'time':>9}   targets: ratio >= 0.90, time <= "
          f"+{MAX_SLOWDOWN + 0.01:.0%}")
    for name, r in report.items():
        ratio = r["energy_saved"] / r["energy_predicted_saved"]
        time_ok = r["energy_step_time_change"] <= MAX_SLOWDOWN + 0.01
        verdict = "ok" if ratio >= 0.9 and time_ok else "MISSED"
        planned = r["steps"] - r["energy_plan_step"] + 1
        print(f"{name:18}{r['energy_profile_steps']:8d}{r['all_max_steps']:8d}{planned:8d}"
              f"{r['energy_predicted_saved']:10.2%}{r['energy_saved']:10.2%}{ratio:7.2f}"
              f"{r['energy_step_time_change']:+9.2%}   {verdict}")
    Path(args.save).write_text(json.dumps({"arguments": vars(args), "report": report}, indent=1))
    print(f"figures written to {args.save}")


if __name__ == "__main__":
    main()
