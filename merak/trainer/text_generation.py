"""`MerakTrainer.generate` and the ``text_generation`` / ``out_seq_length`` / ``temperature``
fields: generation with the trained pipelined model (`merak.generation`), on every rank.

With ``text_generation=True``, `train()` ends by generating ``out_seq_length`` new tokens for
the trainer's ``generation_prompts`` (or, without them, the first half of the first rows of the
eval dataset), sampling at ``temperature`` (greedy at 0); the results are in
``trainer.generations`` and, from rank 0, ``<output_dir>/generations.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from merak.generation import generate

_DEFAULT_PROMPTS = 4  # rows of the eval dataset prompted when no prompts are given


class TextGenerationMixin:
    """Generation for `MerakTrainer` (which provides the build, the stage and the context)."""

    def generate(self, prompts=None, *, max_new_tokens: int | None = None,
                 do_sample: bool = False, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None,
                 eos_token_id: int | None = None, seed: int | None = None) -> list[list[int]]:
        """New token ids for each prompt, with the pipelined model, on every rank.

        Args:
            prompts: strings (tokenized with the trainer's ``processing_class``), lists of
                token ids, or a 2-D tensor; default: the trainer's ``generation_prompts``, else
                the first half of the first eval rows.
            max_new_tokens: default ``args.out_seq_length``.
            do_sample, temperature (default ``args.temperature``), top_k, top_p,
                eos_token_id: as in `merak.generate`.
            seed: default ``args.seed``.
        """
        token_lists = self._prompt_ids(prompts)
        if self.engine is None:  # not trained in this process: build for generation alone
            self._assemble(self._generation_example())
        args = self.args
        zero = self.engine.zero
        gathered = zero.gathered() if zero is not None else contextlib.nullcontext()
        with gathered:  # ZeRO-3: the stage's parameters whole while decoding
            return generate(
                self._user_model, self.stage, token_lists, ctx=self.ctx,
                max_new_tokens=args.out_seq_length if max_new_tokens is None
                else max_new_tokens,
                do_sample=do_sample, temperature=args.temperature if temperature is None
                else temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                seed=args.seed if seed is None else seed,
                prefix=self.loss_choice.name_prefix)

    def _generate_after_training(self) -> None:
        """``text_generation=True``: sample at ``temperature`` (greedy at 0) and report."""
        args = self.args
        prompts = self._prompt_ids(None)
        sampled = args.temperature > 0
        self.generations = self.generate(prompts, do_sample=sampled,
                                         temperature=args.temperature if sampled else 1.0)
        if not self.is_world_process_zero():
            return
        tokenizer = self.processing_class if hasattr(self.processing_class, "decode") else None
        path = Path(args.output_dir) / "generations.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as out:
            for prompt, new in zip(prompts, self.generations):
                row = {"prompt_ids": prompt, "generated_ids": new}
                if tokenizer is not None:
                    row.update(prompt=tokenizer.decode(prompt), generated=tokenizer.decode(new))
                    print(f"[text_generation] {row['prompt']!r} -> {row['generated']!r}")
                out.write(json.dumps(row) + "\n")
        print(f"text_generation: {len(prompts)} prompts, {args.out_seq_length} new tokens "
              f"each at most, written to {path}")

    def _prompt_ids(self, prompts) -> list[list[int]]:
        prompts = self.generation_prompts if prompts is None else prompts
        if prompts is None:
            if self.eval_dataset is None:
                raise ValueError("generation needs prompts: pass them to generate(), or "
                                 "generation_prompts= to MerakTrainer, or give an eval_dataset")
            rows = [self.eval_dataset[i] for i in range(min(_DEFAULT_PROMPTS,
                                                            len(self.eval_dataset)))]
            prompts = []
            for row in rows:
                ids = torch.as_tensor(row["input_ids"])
                if "attention_mask" in row:
                    ids = ids[torch.as_tensor(row["attention_mask"]).bool()]
                prompts.append(ids[:max(1, len(ids) // 2)].tolist())
        if isinstance(prompts, torch.Tensor):
            return prompts.tolist()
        if isinstance(prompts, str):
            prompts = [prompts]
        out = []
        for prompt in prompts:
            if isinstance(prompt, str):
                if not hasattr(self.processing_class, "encode"):
                    raise ValueError("text prompts need a tokenizer: pass processing_class= to "
                                     "MerakTrainer, or give token ids")
                prompt = self.processing_class.encode(prompt)
            out.append([int(t) for t in prompt])
        return out

    def _generation_example(self) -> dict[str, torch.Tensor]:
        """A batch to build the pipeline from when nothing was trained: the train (or eval)
        data's, else token ids of the model's vocabulary."""
        rows = self.args.per_device_train_batch_size
        for dataset in (self.train_dataset, self.eval_dataset):
            if dataset is not None:
                return self._example(dataset, rows)
        ids = torch.zeros((rows, 16), dtype=torch.long)
        return self._counted({"input_ids": ids, "labels": ids.clone()}, 1)
