"""HF fields checked at dp1 x tp1 x pp2 (scenarios of trainer_fp16.py's launch):

- push_to_hub with hub_strategy='all_checkpoints': HF's own push code uploads, from rank 0, the
  HF model directory gathered from the shards at every save, each checkpoint folder, and the
  final model of `trainer.push_to_hub()`; a fake Hub (`FakeHub`) records the uploads, and the
  pushed model.safetensors holds the trained weights.
- ignore_data_skip: resuming mid-epoch starts that epoch's batches from its first one (the
  default skips the batches the checkpoint already saw).
- dataloader_num_workers: batches collated in worker processes give the same losses.
- compute_metrics' inputs: `eval_do_concat_batches=False` (per-step arrays, the last one
  partial), `include_for_metrics` (the inputs in dataset order, each row's micro-batch loss,
  whose mean is eval_loss) and `batch_eval_metrics` (one call per step, `compute_result` on
  the last; a running accuracy equal to the whole-set one).
- auto_find_batch_size: a micro-batch of 8 rows "runs out of memory" on the last stage only (an
  injected out-of-memory error above 2 rows); both ranks agree to halve twice and train as a
  run with 2-row micro-batches does.
- lora_config: LoRA through peft, against single-process peft, with the PEFT directories
  `save_model` and `merak export` write (and `--merge`'s HF weights); then text_generation
  against HF generate on the trained peft model.
The HF-field scenarios return what they saw; test_trainer asserts it.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
from common import Compared
from safetensors.torch import load_file
from trainer_common import build, dataset
from transformers import default_data_collator

import merak
from merak.checkpoint.export import gather_full_tensors

STEPS = 4


class FakeHub:
    """Stands in for `huggingface_hub.HfApi` (no network here): uploads copy into `root`."""

    def __init__(self, root: Path):
        self.root, self.repos, self.uploads = root, [], []

    def create_repo(self, repo_id, token=None, private=None, exist_ok=False, **_):
        self.repos.append((repo_id, private))
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, repo_id, folder_path, commit_message=None, token=None,
                      run_as_future=False, ignore_patterns=(), path_in_repo=None, revision=None,
                      **_):
        target = self.root / repo_id / (path_in_repo or "")
        for file in Path(folder_path).rglob("*"):
            relative = file.relative_to(folder_path)
            if file.is_file() and not any(fnmatch.fnmatch(part, pattern)
                                           for part in relative.parts
                                           for pattern in ignore_patterns or ()):
                (target / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(file, target / relative)
        self.uploads.append((commit_message, path_in_repo))
        if not run_as_future:
            return SimpleNamespace(commit_message=commit_message)
        done = Future()
        done.set_result(None)
        return done


class CountingDataset(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items, self.read = items, []

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        self.read.append(index)
        return self.items[index]


def _trainer(out: Path, train_dataset, **fields) -> merak.MerakTrainer:
    with merak.init_empty_weights():
        model = build("llama")
    options = dict(max_steps=STEPS, per_device_train_batch_size=2,
                   gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1,
                   report_to="none", disable_tqdm=True, use_cpu=True, seed=3,
                   train_sampling_strategy="sequential", save_strategy="no")
    args = merak.MerakArguments(output_dir=str(out), **{**options, **fields})
    return merak.MerakTrainer(model=model, args=args, train_dataset=train_dataset)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _shared_dir(name: str) -> Path:
    return Path(os.environ["MERAK_TRAINER_OUT"]) / name


def push_to_hub() -> dict:
    """What reached the (fake) Hub from this rank: repos made, uploads; on rank 0 the files
    of the pushed repo and its weights against the trained stages' full tensors."""
    merak.init(dp=1, tp=1, pp=2)  # the launch's earlier scenarios change the layout
    out, hub = _shared_dir("hub-run"), FakeHub(_shared_dir("hub"))
    with mock.patch("transformers.trainer.hf_api", lambda: hub):
        trainer = _trainer(out, dataset(16, 3), push_to_hub=True, hub_model_id="me/tiny",
                           hub_strategy="all_checkpoints", hub_private_repo=True,
                           save_strategy="steps", save_steps=2)
        trainer.train()
        trainer.push_to_hub()
    full = gather_full_tensors(trainer.stage, trainer.ctx)
    compared = Compared()
    figures = {"repos": [list(r) for r in hub.repos], "uploads": [list(u) for u in hub.uploads]}
    if dist.get_rank() == 0:
        repo = hub.root / "me" / "tiny"
        pushed = load_file(repo / "model.safetensors")
        figures.update(
            checkpoint_in_dcp=(repo / "checkpoint-4" / "model" / ".metadata").is_file(),
            model_card=(repo / "README.md").is_file(),
            pushed_names=sorted(pushed), full_names=sorted(full))
        for name in set(pushed) & set(full):
            compared.value(f"pushed {name}", pushed[name], full[name])
    return compared.figures(**figures)


def ignore_data_skip() -> dict:
    """Save at step 2 of a 4-step epoch, then resume with and without ignore_data_skip."""
    merak.init(dp=1, tp=1, pp=2)
    items = dataset(16, 4)  # 4 rows per step: one epoch of 4 steps
    out = _shared_dir("skip-run")
    _trainer(out, CountingDataset(items), save_strategy="steps", save_steps=2,
             max_steps=2).train()
    read = {}
    for ignore in (False, True):
        data = CountingDataset(items)
        trainer = _trainer(out, data, max_steps=3, ignore_data_skip=ignore)
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
        read[ignore] = data.read
    # (the first stage reads the inputs, the build's example first)
    return {"read_skipping": read[False], "read_ignoring": read[True]}


def dataloader_workers() -> dict:
    merak.init(dp=1, tp=1, pp=2)
    pids = _shared_dir(f"collate-pids-{dist.get_rank()}")
    pids.mkdir(parents=True, exist_ok=True)

    def collate(items):
        if torch.utils.data.get_worker_info() is not None:
            (pids / str(os.getpid())).touch()
        return default_data_collator(items)

    runs = {}
    for workers in (0, 2):
        loading = {"dataloader_num_workers": workers, "dataloader_prefetch_factor": 2} \
            if workers else {}
        trainer = _trainer(_shared_dir("workers-run"), dataset(16, 5), **loading)
        trainer.data_collator = collate
        trainer.train()
        runs[workers] = _losses(trainer)
    return {"losses_without_workers": runs[0], "losses_with_workers": runs[2],
            "other_processes_collated": len({int(p.name) for p in pids.iterdir()}
                                            - {os.getpid()})}


def auto_find_batch_size() -> dict:
    merak.init(dp=1, tp=1, pp=2)
    def out_of_memory_above_two_rows(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if torch.is_grad_enabled() and not torch.compiler.is_exporting() \
                and hidden.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return output

    runs = {}
    for rows, auto in ((8, True), (2, False)):
        with merak.init_empty_weights():
            model = build("llama")
        model.model.layers[1].register_forward_hook(out_of_memory_above_two_rows)  # last stage
        args = merak.MerakArguments(
            output_dir=str(_shared_dir("auto-batch")), max_steps=3,
            per_device_train_batch_size=rows, gradient_accumulation_steps=2,
            auto_find_batch_size=auto, learning_rate=1e-3, logging_steps=1, report_to="none",
            disable_tqdm=True, use_cpu=True, seed=3, train_sampling_strategy="sequential",
            save_strategy="no")
        trainer = merak.MerakTrainer(model=model, args=args, train_dataset=dataset(32, 6))
        trainer.train()
        runs[f"auto={auto}"] = {"rows": rows, "train_batch_size": trainer.state.train_batch_size,
                                "losses": _losses(trainer)}
    return runs


def eval_metrics_inputs() -> dict:
    merak.init(dp=1, tp=1, pp=2)
    items = dataset(10, 9)  # steps of 4 rows: 4, 4, 2

    def accuracy(prediction):
        predicted, labels = prediction.predictions, prediction.label_ids
        if isinstance(predicted, list):  # eval_do_concat_batches=False
            predicted, labels = np.concatenate(predicted), np.concatenate(labels)
        mask = labels[:, 1:] != -100
        return {"accuracy": float((predicted[:, :-1] == labels[:, 1:])[mask].mean())}

    seen = {}

    def capture(prediction):
        seen["prediction"] = prediction
        return accuracy(prediction)

    running = {"right": 0, "count": 0, "calls": []}

    def batched(prediction, compute_result):
        predicted, labels = prediction.predictions, prediction.label_ids
        mask = labels[:, 1:] != -100
        running["right"] += int((predicted[:, :-1] == labels[:, 1:])[mask].sum())
        running["count"] += int(mask.sum())
        running["calls"].append((len(labels), compute_result))
        return {"accuracy": running["right"] / running["count"]}

    def run(metrics_fn, **fields):
        trainer = _trainer(_shared_dir("eval-run"), dataset(16, 3), per_device_eval_batch_size=4,
                           **fields)
        trainer.compute_metrics = metrics_fn
        trainer.preprocess_logits_for_metrics = lambda logits, labels: logits.argmax(-1)
        return trainer.evaluate(items)

    whole = run(accuracy)
    split = run(capture, eval_do_concat_batches=False, include_for_metrics=["inputs", "loss"])
    prediction = seen["prediction"]
    inputs = np.concatenate(prediction.inputs)
    losses = np.concatenate(prediction.losses)
    per_step = run(batched, batch_eval_metrics=True)
    return {"whole": whole, "split": split, "per_step": per_step,
            "split_batches": [len(p) for p in prediction.predictions],
            "inputs_are_the_items": bool(np.array_equal(
                inputs, np.stack([item["input_ids"] for item in items]))),
            "losses_shape": list(losses.shape), "losses_mean": float(losses.mean()),
            "metric_calls": [list(c) for c in running["calls"]]}


PROMPTS = [[5, 9, 11], [7, 3, 30, 2, 8, 1, 4], [12]]  # text_generation after LoRA training
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "task_type": "CAUSAL_LM",
        "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]}


def _lora_reference(items, lr: float) -> tuple[list[float], torch.nn.Module]:
    """Single-process peft on the same model (adapters made right after set_seed(seed)), data
    order and HF defaults (AdamW, linear decay over STEPS, gradient norm clipped to 1): the
    losses HF logs and the trained model."""
    from peft import LoraConfig, get_peft_model
    from transformers import set_seed

    base = build("llama")
    set_seed(3)  # _trainer's seed: MerakTrainer makes lora_config's adapters right after it
    model = get_peft_model(base, LoraConfig(**LORA))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = lr * (1 - step / STEPS)
        total = 0.0
        for micro in range(2):
            rows = items[step * 4 + micro * 2: step * 4 + micro * 2 + 2]
            batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
            loss = model(**batch).loss / 2
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, model


def lora_trainer() -> dict:
    """`lora_config` through MerakTrainer at pp=2, against single-process peft: the losses,
    which parameters train and whether the frozen ones kept the base weights; `text_generation`
    (greedy) after training, `trainer.generate` and `merak generate` on the saved checkpoint
    against HF generate on the trained peft model; and (rank 0) the logits of what
    `save_model`, `merak export` and `merak export --merge` wrote, loaded back, against the
    trained peft model's (`Compared`)."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from merak.checkpoint.export import export_checkpoint

    merak.init(dp=1, tp=1, pp=2)
    out, items = _shared_dir("lora-run"), dataset(16, 3)
    trainer = _trainer(out, items, lora_config=json.dumps(LORA), save_strategy="steps",
                       save_steps=STEPS, text_generation=True, out_seq_length=5,
                       temperature=0.0)
    trainer.generation_prompts = PROMPTS
    materialized = [n for n, p in trainer._user_model.named_parameters() if not p.is_meta]
    trainer.train()
    trainer.save_model(str(out / "final"))
    want, reference = _lora_reference(items, 1e-3)
    compared = Compared()
    compared.value("losses against single-process peft", _losses(trainer), want)
    base = dict(build("llama").named_parameters())
    trainable, frozen_changed = [], []
    for name, param in trainer.stage.named_parameters():
        if param.requires_grad:
            trainable.append(name)
        elif ".lora_" in name or not torch.equal(param.detach(),
                                                 base[name.replace(".base_layer.", ".")]):
            frozen_changed.append(name)
    generated = []  # text_generation: greedy, as HF generate on the trained peft model
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        new = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=5, do_sample=False)[0, len(prompt):].tolist()
        eos = reference.generation_config.eos_token_id
        generated.append(new[:new.index(eos) + 1] if eos in new else new)
    figures = {"materialized_outside_the_stage": materialized, "trainable": trainable,
               "frozen_changed": frozen_changed, "hf_generated": generated,
               "text_generation": trainer.generations,
               "generate": trainer.generate([PROMPTS[0]], max_new_tokens=3)}
    with mock.patch("builtins.print") as printed:  # `merak generate` on the checkpoint
        from merak.cli import main

        main(["generate", str(out / f"checkpoint-{STEPS}"), "--pp", "2", "--max-new-tokens",
              "5", *[a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]])
    if dist.get_rank() == 0:
        figures["cli_lines"] = [c.args[0] for c in printed.call_args_list]
        figures["cli_expected"] = [f"prompt_ids={p} generated_ids={w}"
                                   for p, w in zip(PROMPTS, generated)]
        rows = (out / "generations.jsonl").read_text().splitlines()
        figures["generations_file"] = [json.loads(r)["generated_ids"] for r in rows]
        ids = items[0]["input_ids"][None]
        with torch.no_grad():
            logits = reference(input_ids=ids).logits
            loaded = PeftModel.from_pretrained(build("llama"), str(out / "final"))
            compared.value("save_model's logits", loaded(input_ids=ids).logits, logits)
            adapter = export_checkpoint(out / f"checkpoint-{STEPS}", out / "exported")
            loaded = PeftModel.from_pretrained(build("llama"), str(adapter))
            compared.value("merak export's logits", loaded(input_ids=ids).logits, logits)
            merged = export_checkpoint(out / f"checkpoint-{STEPS}", out / "merged", merge=True)
            plain = AutoModelForCausalLM.from_pretrained(str(merged))
            compared.value("export --merge's logits", plain(input_ids=ids).logits, logits)
    dist.barrier()
    return compared.figures(**figures)


SCENARIOS = {"lora-trainer": lora_trainer, "push-to-hub": push_to_hub,
             "ignore-data-skip": ignore_data_skip, "dataloader-workers": dataloader_workers,
             "auto-find-batch-size": auto_find_batch_size,
             "eval-metrics-inputs": eval_metrics_inputs}
if __name__ == "__main__":
    from common import run_scenarios

    run_scenarios(SCENARIOS)
