"""LoRA through peft on (dp, tp, pp) layouts against the single-process peft model: meta build
-> `merak.lora.wrap` (adapters join the meta model's init record) -> `merak.parallelize` ->
1f1b interpreter, 3 SGD steps over the trainable (adapter) parameters. Returned next to the
reference's (`Compared`, compared in test_tensor_parallel's body): each step's loss, every
adapter gradient (against this rank's slice), the final adapters, and the logits of the
gathered adapter exported as a PEFT directory that `PeftModel.from_pretrained` loads and merged
as HF weights (see test_lora). Checked here: the base weights are bit-identical to the
reference's and never get a gradient, and every adapter got a gradient."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from common import Compared, GradSnapshot
from hf_models import FAMILIES, batch
from host_objects import no_object_collectives
from peft import LoraConfig, PeftModel, get_peft_model

import merak
from merak import lora
from merak.checkpoint.export import gather_full_tensors, save_hf_directory

STEPS, MICROBATCHES, ROWS, LR, SEED = 3, 2, 2, 0.05, 2024
TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"],
           "gpt2": ["c_attn", "c_proj", "c_fc"]}


def lora_config(family: str) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[family],
                      fan_in_fan_out=family == "gpt2", task_type="CAUSAL_LM")


def _slice(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    spec = getattr(param, "tp_shard", None)
    return spec.take(full) if spec is not None else full


def parity(family: str, dp: int, tp: int, pp: int) -> dict:
    ctx = merak.init(dp=dp, tp=tp, pp=pp)
    torch.manual_seed(SEED)
    with merak.init_empty_weights():
        base = FAMILIES[family]()
    model = lora.wrap(base, lora_config(family))
    stage = merak.parallelize(model, batch(family, 0, ROWS), ctx)
    trainable = [p for p in stage.parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n, p in stage.named_parameters()
                             if p.requires_grad), "a base weight is trainable"
    snapshot = GradSnapshot(stage)
    engine = merak.PipelineInterpreter(stage, ctx, torch.optim.SGD(trainable, lr=LR),
                                       num_microbatches=MICROBATCHES, schedule="1f1b",
                                       hooks=[snapshot])
    rows = ROWS * MICROBATCHES
    losses = []
    for step in range(STEPS):
        full = batch(family, step, rows * dp)
        mine = {k: v[ctx.dp_rank * rows:(ctx.dp_rank + 1) * rows] for k, v in full.items()}
        losses.append(engine.train_step(mine))

    torch.manual_seed(SEED)
    reference = get_peft_model(FAMILIES[family](), lora_config(family))
    params = dict(reference.get_base_model().named_parameters())  # the stage's names
    optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR)
    own = dict(stage.named_parameters())
    compared = Compared()
    for step in range(STEPS):
        loss = reference(**batch(family, step, rows * dp)).loss
        loss.backward()
        compared.value(f"loss of step {step}", float(losses[step]), loss.item())
        got = snapshot.grads[step]
        assert set(got) == {n for n, p in own.items() if p.requires_grad}, \
            f"gradients of {sorted(set(got) ^ {n for n, p in own.items() if p.requires_grad})}"
        for name, grad in got.items():
            compared.grad(f"step {step} grad of {name}", grad,
                          _slice(own[name], params[name].grad))
        optimizer.step()
        optimizer.zero_grad()
    for name, param in own.items():
        want = _slice(param, params[name].detach())
        if param.requires_grad:
            compared.value(f"{name} at the end", param.detach(), want)
        else:
            assert param.grad is None, f"frozen {name} got a gradient"
            assert torch.equal(param.detach(), want), f"frozen {name} changed"
    _export_loads(stage, ctx, family, reference, compared)
    return compared.figures(adapters=len(trainable))


def _export_loads(stage, ctx, family: str, reference, compared: Compared) -> None:
    """The gathered adapter as a PEFT directory, and merged as HF weights, give the trained
    reference's logits."""
    with no_object_collectives():  # shards travel through host memory, one at a time
        tensors = gather_full_tensors(stage, ctx, name_prefix="")
    if ctx.rank == 0:
        ids = batch(family, 9, 2)["input_ids"]
        want = reference(input_ids=ids).logits
        with tempfile.TemporaryDirectory() as tmp:
            lora.save_adapter_directory(tensors, lora_config(family), "default", None,
                                        os.path.join(tmp, "adapter"))
            torch.manual_seed(SEED)
            loaded = PeftModel.from_pretrained(FAMILIES[family](), os.path.join(tmp, "adapter"))
            compared.value("logits of the exported adapter", loaded(input_ids=ids).logits, want)
            merged = lora.merged_tensors(tensors, lora_config(family), "default")
            save_hf_directory(merged, reference.get_base_model(), os.path.join(tmp, "merged"))
            from transformers import AutoModelForCausalLM

            plain = AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "merged"))
            compared.value("logits of the merged weights", plain(input_ids=ids).logits, want)
    dist.barrier()


# run in tp_parity.py's 4- and 8-rank launches (test_tensor_parallel): GPT-2 at (1, 2, 2) has
# its fused q/k/v adapters and its frozen embedding tied across stages; Llama every layout
SCENARIOS = {
    4: {"lora-llama-tp2-pp2": lambda: parity("llama", 1, 2, 2),
        "lora-llama-dp2-pp2": lambda: parity("llama", 2, 1, 2),
        "lora-gpt2-tp2-pp2": lambda: parity("gpt2", 1, 2, 2)},
    8: {"lora-llama-dp2-tp2-pp2": lambda: parity("llama", 2, 2, 2)},
}
