"""`MerakTrainer`'s evaluate / predict: forward-only pipeline steps over every item of the set.

As in HF `Trainer`: every sample counts once (a last partial batch included) and the loss is the
mean over samples of their batch's loss; `per_device_eval_batch_size` rows per dp rank and step
(rounded up to whole micro-batches of the size the pipeline was built for, the training one);
`preprocess_logits_for_metrics(logits, labels)` runs on each step's logits where they are made
(the last pipeline stage), then `compute_metrics(EvalPrediction)` on the gathered results:
once over the whole set (each field concatenated unless `eval_do_concat_batches=False`), or
with `batch_eval_metrics` on each step's global batch (`compute_result` on the last).
`include_for_metrics`: "inputs" adds the model's main input, "loss" each row's loss (that of its
micro-batch; HF repeats each batch's loss over its rows the same way).

TRL's DPOTrainer, KTOTrainer and RewardTrainer evaluate with each micro-batch collated on its
own items, as in training (their collators make two rows of an item, a chosen and a rejected
one, or join KL rows), on sets that fill whole steps; DPO's and KTO's sets are their
``eval_dataset``, whose reference log-probabilities come from the pass before training
(`merak.trainer.reference_logps`); RewardTrainer also evaluates a set given to ``evaluate``,
tokenized as TRL's own ``evaluate`` does. TRL's ``log`` then sees the stage in eval mode, as
after HF's evaluation loop, and takes the metrics kept for evaluation.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch
import torch.distributed as dist
from transformers.trainer_utils import (
    EvalLoopOutput,
    EvalPrediction,
    PredictionOutput,
    denumpify_detensorize,
)

from merak.distributed import liveness
from merak.distributed.host_objects import broadcast_object
from merak.trainer.arguments import NotSupportedYetError
from merak.trainer.data import EvalBatches, check_eval_dataset, check_whole_steps
from merak.trainer.subclasses import is_dpo, is_kto, is_reward


class EvaluationMixin:
    """Mixed into `MerakTrainer` (which provides args, ctx, engine, _assemble, _collate, ...)."""

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
                 ) -> dict[str, float]:
        output = self._merak_eval_loop(eval_dataset if eval_dataset is not None
                                       else self.eval_dataset, metric_key_prefix)
        with _eval_mode(self.model):  # as after HF's evaluation loop: a subclass's log (TRL's)
            self.log(output.metrics)  # takes the metrics its compute_loss kept for evaluation
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control,
                                                         output.metrics)
        return output.metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test"
                ) -> PredictionOutput:
        """Logits (gathered from the last stage of every pipeline, in dataset order), labels and
        metrics (loss, and `compute_metrics` when given) over `test_dataset`."""
        output = self._merak_eval_loop(test_dataset, metric_key_prefix, predictions=True)
        return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids,
                                metrics=output.metrics)

    @liveness.waiting_in("evaluation")
    def _merak_eval_loop(self, dataset, prefix: str, predictions: bool = False
                         ) -> EvalLoopOutput:
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset")
        check_eval_dataset(dataset, "evaluation dataset")
        args, ctx = self.args, self.ctx
        predictions = predictions or (self.compute_metrics is not None
                                      and not args.prediction_loss_only)
        self._check_predictions(predictions)
        # TRL DPO's and RewardTrainer's collators make two rows of an item (a chosen and a
        # rejected one), KTO's joins its KL rows (joined_rows.py): each micro-batch collated
        # on its own items, as in training, so no pair is parted
        reward = is_reward(type(self))
        per_microbatch = is_dpo(type(self)) or is_kto(type(self)) or reward
        given = per_microbatch and dataset is not self.eval_dataset
        if reward and given:  # tokenized as TRL's RewardTrainer.evaluate does (no reference)
            dataset = self._prepare_dataset(dataset, self.processing_class, args, prefix)
            given = False
        mbs = self._train_batch_size  # the micro-batch the pipeline is built for
        m = -(-args.per_device_eval_batch_size // mbs)
        if per_microbatch:
            check_dpo_evaluation(self, given, predictions)
            check_whole_steps(len(dataset), mbs, m, ctx.dp,
                              f"the evaluation set of {type(self).__name__}")
        self._assemble(self._example(dataset, min(mbs, len(dataset))))
        if per_microbatch and not given and not reward:  # with its reference
            dataset = self.eval_dataset  # log-probabilities, once computed
        data = EvalBatches(dataset, self._collate, micro_batch_size=mbs, num_microbatches=m,
                           dp=ctx.dp, dp_rank=ctx.dp_rank,
                           reads_data=bool(self.engine.interpreter.batch_keys),
                           label_names=args.label_names or ("labels",),
                           per_microbatch=per_microbatch)
        steps = data.steps if args.eval_iters is None else min(args.eval_iters, data.steps)
        last = self.engine.interpreter.runners.get(self.engine.interpreter.split.num_stages - 1)
        extras = [x for x in ("inputs", "loss") if x in (args.include_for_metrics or ())]
        per_batch = args.batch_eval_metrics and self.compute_metrics is not None
        weighted = 0.0  # this rank's part of the sum over all samples of their loss
        start, gathered, computed = time.perf_counter(), [], None
        for step in range(steps):
            # HF's token-weighted loss: a step (HF's eval batch on each dp rank) is divided by
            # its token count, over the dp ranks as in training
            batch = self._counted(data.step(step), m, step=True)
            with self._running_loss():  # a subclass's compute_loss: HF's per-batch mean
                self.engine.interpreter.eval_step(batch, m, keep="logits" if predictions else None)
            real = data.real_rows(step)
            row_losses = []  # each real row's loss (HF's "loss" for metrics): its batch's
            share = 0.0  # this rank's part of the sum over all samples of their loss
            if last is not None and self.loss_choice.counts_items \
                    and not self.loss_choice.subclass:
                # the step's loss is the sum over dp ranks of their parts (each divided by the
                # step's token count): every real row of the step takes it, as HF's rows take
                # their batch's; a rank's own rows are shown HF's per-device value
                part = torch.stack([x.reshape(()) for x in last.losses]).double().sum().item()
                across = self.engine.interpreter.loss_weight != 1
                rows = sum(data.real_rows(step, r) for r in range(ctx.dp)) if across else real
                share = part * rows
                row_losses = [part * self.engine.interpreter.loss_weight] * real
            elif last is not None:  # the mean of each micro-batch
                for i, loss in enumerate(last.losses):
                    rows = min(max(real - i * mbs, 0), mbs)
                    row_losses += [loss.double().item()] * rows  # padding only: a NaN loss
                share = sum(row_losses)
            if ctx.tp_rank == 0:
                weighted += share
            if not predictions:
                continue
            mine = None
            if last is not None:
                kept, step_labels = self.engine.interpreter.kept[:real], batch["labels"][:real]
                if self.preprocess_logits_for_metrics is not None:
                    kept = self.preprocess_logits_for_metrics(kept, step_labels)
                name = getattr(self._user_model, "main_input_name", "input_ids")
                mine = (kept, step_labels,
                        *([batch[name][:real]] if "inputs" in extras else []),
                        *([torch.tensor(row_losses)] if "loss" in extras else []))
            parts = self._gather_from_last_stages(mine)
            if per_batch:  # HF's batch_eval_metrics: the last call's result is the metrics
                computed = self.compute_metrics(_prediction(parts, extras),
                                                compute_result=step == steps - 1)
            else:
                gathered.append(parts)
        if self.engine.zero is not None:  # ZeRO-2 kept its blocks whole over the evaluation
            self.engine.zero.reshard()
        total = torch.tensor([weighted], dtype=torch.float64, device=ctx.device)
        if ctx.world_size > 1:
            dist.all_reduce(total)
        samples = data.samples(steps)
        runtime = time.perf_counter() - start
        metrics = {f"{prefix}_loss": total.item() / samples,
                   f"{prefix}_runtime": round(runtime, 4),
                   f"{prefix}_samples_per_second": round(samples / runtime, 3),
                   f"{prefix}_steps_per_second": round(steps / runtime, 3),
                   f"{prefix}_steps": steps}
        prediction = None
        if gathered:  # per field: the steps' arrays, concatenated unless eval_do_concat_batches
            joined = [[_numpy(t) for t in column] for column in zip(*gathered)]
            if args.eval_do_concat_batches:
                joined = [np.concatenate(column) for column in joined]
            prediction = _prediction(joined, extras)
        if prediction is not None and self.compute_metrics is not None:
            computed = self.compute_metrics(prediction)
        if computed is not None:
            metrics.update({k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": v
                            for k, v in denumpify_detensorize(computed).items()})
        return EvalLoopOutput(predictions=prediction.predictions if prediction else None,
                              label_ids=prediction.label_ids if prediction else None,
                              metrics=metrics, num_samples=samples)

    def _gather_from_last_stages(self, mine):
        """(logits, labels, ...) of a global batch, on every rank: each last-stage rank's share,
        in dp order (tp ranks of a last stage hold the same values: tp rank 0's travels).

        The shares travel as CPU tensors through host memory, one share at a time from each
        sender to every rank (`broadcast_object` over the host group): the result is needed on
        the host (numpy for `compute_metrics`), and a rank holds one share in flight besides
        it. (torch's `all_gather_object` staged world size times the largest share on every
        rank's GPU under NCCL, a copy for each rank that has none.)"""
        ctx = self.ctx
        if mine is not None:
            mine = tuple(t.detach().cpu() for t in mine)
        if ctx.world_size == 1:
            return [torch.cat(column) for column in zip(*[s for s in [mine] if s is not None])]
        last = self.engine.interpreter.placement[-1]  # the pipeline rank of the last stage
        senders = [ctx.rank_of(pp_rank=last, dp_rank=d, tp_rank=0) for d in range(ctx.dp)]
        if ctx.rank in senders and mine is None:
            raise RuntimeError(f"rank {ctx.rank} runs the last stage but kept no outputs to "
                               f"gather")
        shares = [broadcast_object(mine if ctx.rank == src else None, src, ctx.host_group())
                  for src in senders]
        return [torch.cat(column) for column in zip(*shares)]


def _prediction(parts, extras: list[str]) -> EvalPrediction:
    """HF's EvalPrediction of (predictions, labels, then the `include_for_metrics` extras)."""
    named = dict(zip(extras, parts[2:]))
    return EvalPrediction(predictions=parts[0], label_ids=parts[1], inputs=named.get("inputs"),
                          losses=named.get("loss"))


@contextlib.contextmanager
def _eval_mode(model):
    training = getattr(model, "training", False)
    if training:
        model.eval()
    try:
        yield
    finally:
        if training:
            model.train()


def check_dpo_evaluation(trainer, given: bool, predictions: bool) -> None:
    """What of a DPOTrainer's, KTOTrainer's or RewardTrainer's evaluation a pipeline cannot run
    yet, refused by name before the first step: predictions (``predict``, ``compute_metrics``:
    their results are the loss and TRL's metrics), and (DPO, KTO) a set other than the
    ``eval_dataset`` it was given (TRL tokenizes those and computes their reference in its
    ``__init__``)."""
    name = type(trainer).__name__
    if predictions:
        raise NotSupportedYetError(
            f"{name}: predict() and compute_metrics through the pipeline: TRL's preference "
            f"collator makes two rows of an item (DPO, reward) or joins its KL rows (KTO), and "
            f"the logits would need pairing; evaluate() gives TRL's loss and metrics")
    if given:
        raise NotSupportedYetError(
            f"{name}.evaluate(dataset) on a set it was not given as eval_dataset: TRL tokenizes "
            f"its evaluation sets and MerakTrainer computes their reference log-probabilities "
            f"through the pipeline before anything trains; pass the set as eval_dataset when "
            f"making the trainer")


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return (tensor.float() if tensor.is_floating_point() else tensor).cpu().numpy()
