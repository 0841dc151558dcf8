"""What the planner's dry runs and the batch-size probe leave behind on 2 ranks (see
test_plan_memory):

- dry-runs-free-their-groups: candidate after candidate (pp2 with tied embeddings, so
  tied-weight groups too; dp2 with ZeRO-1; tp2): the live process groups before, during and
  after each run, and whether the caller's default context is the default again.
- online-plan-frees-its-groups: the groups `plan_online` leaves behind with one and with two
  dry runs.
- online-plan-dry-runs-cp: the step losses of a pp=2 and of cp=2 dry runs (ring, Ulysses) on
  the same rows; the cp degrees an online plan searched, and what a cp-only plan measured and
  chose.
- online-plan-dry-runs-ep: the step losses of dp2 ep1 and dp2 ep2 dry runs of a tiny Qwen3-MoE on
  the same rows, the groups each left, and what an ep-only online plan measured and chose.
- zero1-pending-state-is-the-shard: the optimizer state the batch-size probe sets aside under
  ZeRO-1 on this rank, its shard's size and the ranks' sum.
- dry-run-trains-as-the-trainer: MerakTrainer's step losses and a dry run's built from the
  same options.

Each returns its figures; test_plan_memory asserts them.
"""

from __future__ import annotations

import os

import torch
import transformers as tf
from common import one_call_block_samples, run_scenarios

import merak
from merak.distributed.teardown import live_process_groups
from merak.dryrun import run as dry_run
from merak.strategy.candidate import Candidate

SEQ = 16


def tiny_llama() -> tf.LlamaConfig:
    return tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          tie_word_embeddings=True)


def step_rows(config, rows: int, steps: int, seed: int):
    """`batches(k)` for a dry run: step k's `rows` random token rows (a warm-up step more)."""
    ids = torch.randint(0, config.vocab_size, ((steps + 1) * rows, SEQ),
                        generator=torch.Generator().manual_seed(seed))

    def batch(k):
        part = ids[k * rows:(k + 1) * rows]
        return {"input_ids": part, "labels": part}

    return batch


def dry_runs_free_their_groups() -> dict:
    ctx = merak.init(dp=1, tp=1, pp=2)
    before = live_process_groups()
    inside, after, figures = [], [], []
    run = dry_run._run

    def counted(*args, **kwargs):
        figures = run(*args, **kwargs)
        inside.append(live_process_groups())  # the candidate's groups, still alive
        return figures

    dry_run._run = counted
    try:
        for c in (Candidate(1, 1, 2, 1, 2), Candidate(2, 1, 1, 1, 2, zero=1),
                  Candidate(1, 2, 1, 1, 2)):
            measured = dry_run.dry_run(c, tiny_llama(), SEQ, steps=1)
            figures.append([c.label, measured.step_s, measured.peak_bytes])
            after.append(live_process_groups())
    finally:
        dry_run._run = run
    torch.distributed.barrier(ctx.pp_group)  # the caller's groups still work
    return {"measured": figures, "groups_before": before, "groups_inside": inside,
            "groups_after": after, "default_context_kept": merak.get_context() is ctx}


def online_plan_frees_its_groups() -> dict:
    from merak.dryrun.online import plan_online

    merak.init(dp=1, tp=1, pp=2)
    with one_call_block_samples():
        left, measured = [], []
        for count in (1, 2):
            before = live_process_groups()
            plan = plan_online(tiny_llama(), 4, SEQ, memory_bytes=2**40, micro_batch_sizes=(1,),
                               dry_runs=count, steps=1)
            measured.append(len(plan.measured))
            left.append(live_process_groups() - before)
    return {"dry_runs": [1, 2], "measured": measured, "groups_left": left}


def online_plan_dry_runs_cp() -> dict:
    from merak.dryrun.online import plan_online

    merak.init(dp=1, tp=1, pp=2)
    config = tiny_llama()
    mbs, m, steps = 2, 2, 2
    rows = step_rows(config, mbs * m, steps, 3)

    losses = {}
    for c in (Candidate(1, 1, 2, mbs, m), Candidate(1, 1, 1, mbs, m, cp=2, cp_mode="ring"),
              Candidate(1, 1, 1, mbs, m, cp=2, cp_mode="ulysses")):
        losses[c.label] = dry_run.dry_run(c, config, SEQ, steps=steps, batches=rows).losses
    with one_call_block_samples():
        searched = plan_online(config, 4, SEQ, memory_bytes=2**40, micro_batch_sizes=(1,),
                               dry_runs=1, steps=1, context_parallel=(1, 2))
        only_cp = plan_online(config, 4, SEQ, memory_bytes=2**40, micro_batch_sizes=(1,),
                              dry_runs=2, steps=1, context_parallel=(2,))
    return {"losses": {label: list(values) for label, values in losses.items()},
            "searched_cp": sorted({p.candidate.cp for p in searched.ranked}),
            "only_cp_measured": only_cp.measured, "only_cp_chosen_cp": only_cp.chosen.cp}


def online_plan_dry_runs_ep() -> dict:
    """Dry runs of a tiny Qwen3-MoE at dp2 ep1 and dp2 ep2 on the same rows (their losses), the
    process groups left after each, and what an ep-only online plan measured and chose."""
    from merak.dryrun.online import plan_online

    merak.init(dp=2, tp=1, pp=1)
    config = tf.Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                               moe_intermediate_size=16, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               num_experts=4, num_experts_per_tok=2)
    mbs, m, steps = 2, 2, 2
    rows = step_rows(config, mbs * m, steps, 5)

    losses, left = {}, []
    for c in (Candidate(2, 1, 1, mbs, m), Candidate(2, 1, 1, mbs, m, ep=2)):
        before = live_process_groups()
        losses[c.label] = list(dry_run.dry_run(c, config, SEQ, steps=steps, batches=rows).losses)
        left.append(live_process_groups() - before)
    with one_call_block_samples():
        for degrees in ((1,), (2,)):  # (a plan leaves its final default layout's groups)
            before = live_process_groups()
            only_ep = plan_online(config, 4, SEQ, memory_bytes=2**40, micro_batch_sizes=(2,),
                                  dry_runs=1, steps=1, expert_parallel=degrees)
            left.append(live_process_groups() - before)
    return {"losses": losses, "groups_left": left, "only_ep_measured": only_ep.measured,
            "only_ep_chosen_ep": only_ep.chosen.ep}


def zero1_pending_state_is_the_shard() -> dict:
    from merak.data_parallel.zero1 import local_optimizer, zero1
    from merak.runtime.memory_probe import pending_optimizer_state_bytes

    ctx = merak.init(dp=2, tp=1, pp=1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16),
                                torch.nn.Linear(16, 4))
    optimizer = zero1(torch.optim.AdamW(model.parameters()), ctx)
    mine = sum(p.numel() for g in local_optimizer(optimizer).param_groups for p in g["params"])
    total = sum(p.numel() for p in model.parameters())
    pending = pending_optimizer_state_bytes(optimizer)
    shares = torch.tensor([pending])
    torch.distributed.all_reduce(shares, group=ctx.dp_group)
    return {"mine": mine, "total": total, "pending": pending, "summed": shares.item()}


def dry_run_trains_as_the_trainer() -> dict:
    """One options object, two builders: MerakTrainer trains a tied-embedding Llama at pp=2
    (1F1B, 4 micro-batches of 2 rows, AdamW, clipping) and the planner's dry run of the same
    candidate, built from the options the trainer used, steps the same rows: every step's
    loss is the same."""
    import tempfile

    ctx = merak.init(dp=1, tp=1, pp=2)
    config = tiny_llama()
    mbs, m, steps = 2, 4, 3
    ids = torch.randint(0, config.vocab_size, ((steps + 1) * mbs * m, SEQ),
                        generator=torch.Generator().manual_seed(7))
    with tempfile.TemporaryDirectory() as out:
        args = merak.MerakArguments(
            output_dir=out, max_steps=steps + 1, per_device_train_batch_size=mbs,
            gradient_accumulation_steps=m, learning_rate=1e-3, lr_scheduler_type="constant",
            weight_decay=0.0, max_grad_norm=0.5, logging_steps=1, report_to="none",
            use_cpu=True, save_strategy="no", train_sampling_strategy="sequential",
            optim="adamw_torch", disable_tqdm=True)
        torch.manual_seed(0)  # as the dry run builds its model
        with merak.init_empty_weights():
            model = tf.AutoModelForCausalLM.from_config(config)
        trainer = merak.MerakTrainer(model=model, args=args, train_dataset=[
            {"input_ids": row, "labels": row} for row in ids])
        trainer.train()
        trained = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        options = args.engine_options(pp=ctx.pp, dp=ctx.dp)
        # the trainer's engine came from these options (its loss wrapper keeps the split's
        # pieces opaque the same way: no leaf modules of its own here)
        same_options = trainer.engine_options == options
    rows = mbs * m
    measured = dry_run.dry_run(
        Candidate(1, 1, 2, mbs, m), config, SEQ, steps=steps, options=options,
        make_optimizer=lambda stage: torch.optim.AdamW(stage.parameters(), lr=1e-3,
                                                       weight_decay=0.0),
        batches=lambda k: {"input_ids": ids[k * rows:(k + 1) * rows],
                           "labels": ids[k * rows:(k + 1) * rows]})
    return {"same_options": same_options,
            "options_unchanged": options == args.engine_options(pp=ctx.pp, dp=ctx.dp),
            "trainer_losses": trained, "dry_run_losses": list(measured.losses)}


SCENARIOS = {"dry-run-trains-as-the-trainer": dry_run_trains_as_the_trainer,
             "dry-runs-free-their-groups": dry_runs_free_their_groups,
             "online-plan-frees-its-groups": online_plan_frees_its_groups,
             "online-plan-dry-runs-cp": online_plan_dry_runs_cp,
             "online-plan-dry-runs-ep": online_plan_dry_runs_ep,
             "zero1-pending-state-is-the-shard": zero1_pending_state_is_the_shard}


def scenarios(world_size: int) -> dict:
    assert world_size == 2, f"plan_dry_runs runs on 2 ranks, not {world_size}"
    return SCENARIOS


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
