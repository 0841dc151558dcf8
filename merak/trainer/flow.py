"""`MerakTrainer`'s training flow around each step, with HF `Trainer`'s meaning.

- Evaluation during train(): `eval_strategy` 'steps' (every `eval_steps`, and at the last step)
  or 'epoch', from step `eval_delay` on, and `eval_on_start`; `DefaultFlowCallback` sets
  `control.should_evaluate` exactly as for HF Trainer, the metrics go through `log` and the
  callbacks' `on_evaluate` (so `EarlyStoppingCallback` sees them), and a
  `ReduceLROnPlateau` scheduler steps on them (HF's `_evaluate`).
- The best model: HF's `_determine_best_metric` (`metric_for_best_model`,
  `greater_is_better`) after each of those evaluations; `save_strategy='best'` saves exactly
  when it improves, 'steps' / 'epoch' when `DefaultFlowCallback` says so; the best checkpoint
  survives `save_total_limit` and `load_best_model_at_end` loads its weights on every rank.
- `include_num_input_tokens_seen`: the tokens of each global batch (every dp share, counted
  once), in `state.num_input_tokens_seen` and so in the logs.
- `torch_empty_cache_steps`: `torch.cuda.empty_cache()` every that many steps (nothing on CPU).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from transformers.trainer_utils import SaveStrategy

from merak.distributed import liveness


class TrainingFlowMixin:
    """Mixed into `MerakTrainer` (which provides args, ctx, state, control, evaluate, ...)."""

    def _begin_flow(self, max_steps: int) -> None:
        """After the state is made: absolute logging / eval / save steps (a fraction of
        max_steps below 1), as HF's `TrainerState.compute_steps`."""
        self.state.compute_steps(self.args, max_steps)
        self._initial_num_input_tokens_seen = self.state.num_input_tokens_seen

    def _evaluate_on_start(self) -> None:
        if self.args.eval_on_start:  # as HF: no best-model bookkeeping, no scheduler step
            self._evaluate(None, None, skip_scheduler=True)

    def _merak_evaluate_and_save(self) -> None:
        """HF's `_maybe_log_save_evaluate` past its logging part (MerakTrainer logs itself)."""
        if self.control.should_evaluate:
            metrics = self._evaluate(None, None)
            new_best = self._determine_best_metric(metrics=metrics, trial=None)
            if self.args.save_strategy == SaveStrategy.BEST:
                self.control.should_save = new_best
        if self.control.should_save:
            self._save_merak_checkpoint()

    def _count_input_tokens(self, batch: list[dict] | None) -> None:
        """HF's `_track_num_input_tokens` for a whole global batch (each dp share the list of
        its micro-batches): each dp share is counted by the ranks that read it (they agree),
        then the shares are summed."""
        mode = self.args.include_num_input_tokens_seen
        if mode in ("no", False, None):
            return
        name = getattr(self._user_model, "main_input_name", "input_ids")
        count = -1
        if batch is not None and all(name in mb for mb in batch):
            count = sum(self._input_tokens(mb, name, mode) for mb in batch)
        counts = torch.full((self.ctx.dp,), -1, dtype=torch.int64, device=self.ctx.device)
        counts[self.ctx.dp_rank] = count
        if self.ctx.world_size > 1:
            with liveness.waiting("the input-token count all-reduce"):
                dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        if (counts < 0).any():
            if not getattr(self, "_warned_tokens", False):
                warnings.warn(f"include_num_input_tokens_seen: the batches have no {name!r} (the "
                              f"model's main_input_name) to count", stacklevel=2)
                self._warned_tokens = True
            return
        self.state.num_input_tokens_seen += int(counts.sum())

    def _input_tokens(self, batch: dict, name: str, mode) -> int:
        if mode != "non_padding":
            return batch[name].numel()
        pad = getattr(self.processing_class, "pad_token_id", None)
        if "attention_mask" in batch:
            return int(batch["attention_mask"].sum())
        return int((batch[name] != pad).sum()) if pad is not None else batch[name].numel()

    def _empty_device_cache(self, step: int) -> None:
        """HF's `torch_empty_cache_steps`, checked on the step being run (0-based, as HF's
        global_step before the increment)."""
        every = self.args.torch_empty_cache_steps
        if every and step % every == 0 and self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()
