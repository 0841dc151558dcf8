"""fp8 (torchao float8 linears, emulated on CPU) through `build_engine` at (dp1 pp2) and
(dp2 pp1), with tp, under ZeRO-2/3 (FSDP2; shards gathered whole to compare), with peft's
LoRA adapters and with context parallelism (pp2 cp2, tp2 cp2: each rank trains on its share of
every row, the reference on the whole rows): every step's loss, every gradient and the final
weights against a single-process model converted the same way (`merak.engine.fp8.convert_`)
and trained on the same micro-batches (fp8's dynamic scales are per matmul, so the reference
runs each micro-batch on its own, accumulating gradients, as the pipeline does). The scenarios
return their figures (`trained_like`), which test_fp8 compares."""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import transformers as tf
from common import Compared, GradSnapshot, out_dir, run_scenarios, trained_like
from hf_models import LLAMA_LIKE, VOCAB
from peft import LoraConfig, get_peft_model
from torch.distributed.tensor import DTensor

import merak
from merak import lora
from merak.context_parallel import enable_context_parallel, split_batch
from merak.context_parallel.split import IGNORE_INDEX, shift_labels
from merak.engine.assemble import build_engine
from merak.engine.fp8 import ADAPTER, apply_fp8, convert_
from merak.engine.options import CompileOptions, EngineOptions, PrecisionOptions
from merak.runtime.options import RuntimeOptions
from merak.stages.stage import block_names
from merak.tensor_parallel.plans.options import TensorParallelOptions

STEPS, MICROBATCHES, ROWS, SEQ, LR, SEED = 3, 2, 2, 16, 0.05, 1234
RECIPES = ("tensorwise", "rowwise")
FULL = os.environ.get("MERAK_TEST_MATRIX") == "full"


def make_llama():
    """A tiny Llama whose linears all divide by 16 (hidden 64, MLP 128, k/v 32)."""
    config = tf.LlamaConfig(vocab_size=VOCAB, num_hidden_layers=2, **LLAMA_LIKE)
    return tf.AutoModelForCausalLM.from_config(config)


def rows(step: int, count: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(2, VOCAB, (count, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def cut(batch: dict, parts: int) -> list[dict]:
    return [{k: v.chunk(parts)[i] for k, v in batch.items()} for i in range(parts)]


def lora_config() -> LoraConfig:
    """Adapters of rank 16 on every projection: their A (64 -> 16) divides by 16 like the
    converted linears, so only the adapter rule keeps it in high precision."""
    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj"])


def reference(recipe: str, steps: list[list[dict]], autocast: torch.dtype | None = None,
              adapters: bool = False):
    """The single-process fp8 model trained with SGD, each step over its micro-batches one at a
    time (loss / micro-batches, gradients accumulated): the steps' mean losses, gradients and
    the final parameters. `adapters`: peft's LoRA model of it, wrapped before the conversion
    (as the pipeline is), training the adapters."""
    torch.manual_seed(SEED)
    model = make_llama().train()
    if adapters:
        model = get_peft_model(model, lora_config())
    convert_(model, recipe, emulate=True)
    named = model.get_base_model() if adapters else model  # the stage's names
    params = {n: p for n, p in named.named_parameters() if p.requires_grad}
    optimizer = torch.optim.SGD(params.values(), lr=LR)
    losses, grads = [], []
    for microbatches in steps:
        total = 0.0
        for data in microbatches:
            with torch.autocast("cpu", autocast) if autocast is not None else nullcontext():
                loss = model(**data).loss
            (loss / len(microbatches)).backward()
            total += loss.item() / len(microbatches)
        losses.append(total)
        grads.append({n: p.grad.clone() for n, p in params.items()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in named.named_parameters()}


def _engine(recipe: str | None, ctx, microbatch: dict, make_optimizer, autocast=None,
            recompute: float = 0.0, sequence_parallel: bool = False, hooks=None, zero: int = 0,
            adapters: bool = False, compile_backend: str | None = None):
    torch.manual_seed(SEED)
    with merak.init_empty_weights():
        model = make_llama()
    if ctx.cp > 1:  # attention across the cp ranks' shares of each row, as MerakTrainer does
        enable_context_parallel(model, ctx.cp_group, "ring")
    if adapters:
        model = lora.wrap(model, lora_config())
    options = EngineOptions(pipeline=RuntimeOptions(num_microbatches=MICROBATCHES,
                                                    recompute_ratio=recompute),
                            tensor_parallel=TensorParallelOptions(
                                sequence_parallel=sequence_parallel),
                            precision=PrecisionOptions(fp8=recipe, autocast_dtype=autocast,
                                                       zero_stage=zero),
                            compile=CompileOptions(enabled=compile_backend is not None,
                                                   backend=compile_backend))
    return build_engine(model, microbatch, ctx, options, make_optimizer=make_optimizer,
                        stage_hooks=hooks)


def _whole(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ZeRO-2/3's shards (DTensors) as whole tensors (every dp rank gathers them in the same
    name order); other tensors as they are."""
    return {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in tensors.items()}


def _this_rank(stage, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference's `tensors` as this rank holds them: its TP shard of a sharded one."""
    own = dict(stage.named_parameters())
    spec = {n: getattr(own.get(n), "tp_shard", None) for n in tensors}
    return {n: t if spec[n] is None else spec[n].take(t) for n, t in tensors.items()}


def _cp_share(microbatch: dict, ctx) -> dict:
    """cp rank's load-balanced share of a micro-batch of whole rows (`split_batch`), its loss
    divided by the micro-batch's whole target count (HF's ``num_items_in_batch``), as
    MerakTrainer cuts it: the cp ranks' losses sum to the whole rows' loss."""
    shifted = shift_labels(microbatch["labels"])
    return {**split_batch({**microbatch, "shift_labels": shifted}, ctx.cp, ctx.cp_rank),
            "num_items_in_batch": (shifted != IGNORE_INDEX).sum()}


def trains_like_one_process(recipe: str, dp: int, pp: int, autocast: torch.dtype | None = None,
                            recompute: float = 0.0, tp: int = 1,
                            sequence_parallel: bool = False, zero: int = 0,
                            adapters: bool = False, compile_backend: str | None = None,
                            cp: int = 1) -> dict:
    """`cp` > 1: each rank trains on its cp share of every micro-batch's rows (ring attention
    across the cp ranks), the reference on the whole rows."""
    ctx = merak.init(dp=dp, tp=tp, pp=pp, cp=cp)
    global_rows = ROWS * MICROBATCHES * dp
    batches = [rows(step, global_rows) for step in range(STEPS)]
    mine = [cut(b, dp)[ctx.dp_rank] for b in batches]  # this dp rank's rows
    if cp > 1:  # the micro-batches themselves, each cut to this cp rank's share
        mine = [[_cp_share(mb, ctx) for mb in cut(b, MICROBATCHES)] for b in mine]
    snapshots = []

    def snapshot(stage):
        snapshots.append(GradSnapshot(stage))
        return snapshots

    engine = _engine(recipe, ctx, mine[0][0] if cp > 1 else cut(mine[0], MICROBATCHES)[0],
                     lambda s: torch.optim.SGD([p for p in s.parameters() if p.requires_grad],
                                               lr=LR),
                     autocast, recompute, sequence_parallel, snapshot, zero, adapters,
                     compile_backend)
    assert engine.fp8 is not None and engine.fp8.converted, engine.fp8
    assert all(type(m).__name__.startswith("Float8") for n, m in engine.stage.named_modules()
               if n in engine.fp8.converted)
    assert all(not n.endswith("lm_head") for n in engine.fp8.converted), engine.fp8.converted
    assert ("lm_head" in engine.fp8.kept) == ctx.is_last_pp_rank, engine.fp8.kept
    kinds = {type(m).__name__ for n, m in engine.stage.named_modules()
             if n in engine.fp8.converted}
    if tp > 1:  # Merak's column- and row-parallel linears, in float8
        assert kinds == {"Float8ColumnParallelLinear", "Float8RowParallelLinear"}, kinds
    if recompute:
        assert any(engine.interpreter.segments), engine.interpreter.segments  # blocks recomputed
    if compile_backend:  # every block's forward compiled, over its float8 linears
        blocks = block_names(engine.stage.split, engine.stage.stage_id)
        assert blocks and all("forward" in vars(engine.stage.get_submodule(n)) for n in blocks)
    if zero:
        _check_zero(engine, recipe)
    if adapters:  # the base linears in float8, peft's adapters kept
        assert all(n.endswith(".base_layer") for n in engine.fp8.converted), engine.fp8.converted
        kept = [n for n, why in engine.fp8.kept.items() if why == ADAPTER]
        assert len(kept) == 2 * len(engine.fp8.converted), engine.fp8.kept
    losses = [engine.interpreter.train_step(b) for b in mine]
    if zero and recipe == "tensorwise":  # each step's scales came from the optimizer step
        assert all(m.weight._local_tensor._precomputed_scale is not None
                   for n, m in engine.stage.named_modules() if n in engine.fp8.converted)
    # the reference's micro-batches: each dp rank's, in turn (the dp all-reduce averages them)
    steps = [[mb for r in range(dp) for mb in cut(cut(b, dp)[r], MICROBATCHES)]
             for b in batches]
    ref_losses, ref_grads, ref_final = reference(recipe, steps, autocast, adapters)
    ref_grads = [_this_rank(engine.stage, g) for g in ref_grads]
    snapshots[0].grads = [_whole(g) for g in snapshots[0].grads]
    figures = trained_like(losses, snapshots[0], _Whole(engine.stage), ref_losses, ref_grads,
                           _this_rank(engine.stage, ref_final))
    figures["float8_classes"] = sorted(kinds)
    if cp > 1:  # the casts that MAX-reduce their amax over the cp group
        figures["cp_casts"] = sorted({cast for n, m in engine.stage.named_modules()
                                      if n in engine.fp8.converted
                                      for cast, groups in m.fp8_tp_groups.items()
                                      if any(g is ctx.cp_group for g in groups)})
    if zero:
        figures["checkpoint"] = _checkpoint_round_trip(engine.stage, ctx, ref_final,
                                                       f"{recipe}-zero{zero}-pp{pp}")
    return figures


def _checkpoint_round_trip(stage, ctx, ref_final: dict, label: str) -> int:
    """ZeRO-3's float8 shards (torchao's weight wrapper under tensorwise) saved as a Merak
    checkpoint hold the reference's fp32 weights under the HF names, and load back into the
    sharded stage: how many tensors were checked."""
    from merak.checkpoint.io import full_tensors, load_checkpoint, save_checkpoint

    path = save_checkpoint(out_dir() / f"fp8-checkpoint-{label}", STEPS, ctx, stage, {})
    for name, tensor in full_tensors(path, names=list(_whole(dict(stage.named_parameters())))
                                     ).items():
        assert tensor.dtype == torch.float32, (name, tensor.dtype)
        torch.testing.assert_close(tensor, ref_final[name], rtol=1e-5, atol=1e-6, msg=name)
    before = _whole(dict(stage.named_parameters()))
    with torch.no_grad():
        for p in stage.parameters():
            p.zero_()
    load_checkpoint(path, ctx, stage)
    after = _whole(dict(stage.named_parameters()))
    for name, tensor in after.items():
        assert torch.equal(tensor, before[name]), name
    return len(after)


class _Whole:
    """`stage`'s parameters as whole tensors, for `trained_like`."""

    def __init__(self, stage):
        self.stage = stage

    def named_parameters(self):
        return _whole(dict(self.stage.named_parameters())).items()


def _check_zero(engine, recipe: str) -> None:
    """ZeRO-2/3 sharded the float8 linears; ``tensorwise`` gathers their weights in float8
    (torchao's wrapper under each shard), ``rowwise`` in high precision."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    assert engine.zero is not None
    weights = [m.weight for n, m in engine.stage.named_modules() if n in engine.fp8.converted]
    assert weights and all(isinstance(w, DTensor) for w in weights)
    wrapped = {isinstance(w.to_local(), WeightWithDynamicFloat8CastTensor) for w in weights}
    assert wrapped == {recipe == "tensorwise"}, (recipe, wrapped)


def twenty_steps(dp: int, tp: int, pp: int) -> dict:
    """20 AdamW steps (lr 3e-3, 4 batches repeated, micro-batches of 4 rows at every layout:
    a dynamic scale depends on the rows a matmul sees) through `build_engine` in fp32 and in
    each fp8 recipe: every step's loss, for test_fp8's 1% bound."""
    ctx = merak.init(dp=dp, tp=tp, pp=pp)
    batches = [cut(rows(100 + i % 4, 4 * MICROBATCHES * dp), dp)[ctx.dp_rank]
               for i in range(20)]
    losses = {}
    for recipe in (None, *RECIPES):
        engine = _engine(recipe, ctx, cut(batches[0], MICROBATCHES)[0],
                         lambda s: torch.optim.AdamW(s.parameters(), lr=3e-3))
        losses[str(recipe)] = [engine.interpreter.train_step(b) for b in batches]
    return {"losses": losses}


def context_parallel(recipe: str, mode: str) -> dict:
    """cp2: the model's attention across the cp ranks (`enable_context_parallel`), its linears
    converted by `apply_fp8` for a cp context (each rank holds a share of every row's tokens:
    the token casts' amax reduced over cp), 2 steps' summed losses and cp-summed gradients
    against the single-process float8 model on the whole rows (as test_context_parallel)."""
    ctx = merak.init(dp=1, tp=1, pp=1, cp=dist.get_world_size())
    torch.manual_seed(SEED)
    reference = make_llama()
    model = make_llama()  # a config of its own: enabling cp edits the config in place
    model.load_state_dict(reference.state_dict())
    convert_(reference, recipe, emulate=True)
    enable_context_parallel(model, ctx.cp_group, mode)
    report = apply_fp8(model, PrecisionOptions(fp8=recipe), ctx)
    kinds = {type(model.get_submodule(n)).__name__ for n in report.converted}
    assert kinds == {"Float8SequenceShardLinear"}, kinds
    compared = Compared()
    for step in range(2):
        data = rows(step, ROWS)
        expected = reference(**data)
        expected.loss.backward()
        count = torch.tensor(int(data["labels"][:, 1:].ne(-100).sum()))
        loss = model(**split_batch(data, ctx.cp, ctx.cp_rank), num_items_in_batch=count).loss
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=ctx.cp_group)
        compared.value(f"step {step} loss", total, expected.loss.detach())
        ours = dict(model.named_parameters())
        for name, param in reference.named_parameters():
            grad = ours[name].grad.clone()
            dist.all_reduce(grad, group=ctx.cp_group)  # cp ranks hold the same weights
            compared.grad(f"step {step} grad of {name}", grad, param.grad)
        for m in (model, reference):
            m.zero_grad()
    return compared.figures()


def scenario_names(world_size: int) -> list[str]:
    return list(scenarios(world_size))


def scenarios(world_size: int) -> dict:
    """At 2 ranks (dp1 pp2), (dp2 pp1), (tp2), dp2 under ZeRO-3 and pp2 with LoRA with each
    recipe, pp2 under bf16 autocast and with recomputation, tp2 with sequence parallelism, dp2
    under ZeRO-2 (tensorwise); at 4 ranks (dp2 pp2), (tp2 pp2) and dp2 pp2 under ZeRO-3, and
    (pp2 cp2) and (tp2 cp2) through build_engine (tensorwise);
    at 8 (dp2 tp2 pp2); and 20 steps in fp32 and fp8 at tp2 (at tp2 pp2 and dp2 tp2 pp2 too
    with MERAK_TEST_MATRIX=full: the layouts' parity above makes them the same run)."""
    assert world_size in (2, 4, 8), f"fp8_parity runs on 2, 4 or 8 ranks, not {world_size}"
    table = {}
    if world_size == 8:
        for recipe in RECIPES:
            table[f"llama-dp2-tp2-pp2-{recipe}"] = lambda r=recipe: trains_like_one_process(
                r, 2, 2, tp=2)
        if FULL:
            table["llama-dp2-tp2-pp2-twenty-steps"] = lambda: twenty_steps(2, 2, 2)
        return table
    if world_size == 4:
        for recipe in RECIPES:
            table[f"llama-dp2-pp2-{recipe}"] = lambda r=recipe: trains_like_one_process(r, 2, 2)
            table[f"llama-tp2-pp2-{recipe}"] = lambda r=recipe: trains_like_one_process(
                r, 1, 2, tp=2)
            table[f"llama-dp2-pp2-zero3-{recipe}"] = lambda r=recipe: trains_like_one_process(
                r, 2, 2, zero=3)
        # context parallelism through build_engine (ring attention; the token casts' amax
        # reduced over cp by apply_fp8) with a pipeline: whole rows in the reference
        table["llama-pp2-cp2-tensorwise"] = lambda: trains_like_one_process(
            "tensorwise", 1, 2, cp=2)
        # tp x cp: the column- and row-parallel float8 linears reduce over tp, then cp
        table["llama-tp2-cp2-tensorwise"] = lambda: trains_like_one_process(
            "tensorwise", 1, 1, tp=2, cp=2)
        if FULL:
            table["llama-tp2-pp2-twenty-steps"] = lambda: twenty_steps(1, 2, 2)
        return table
    for recipe in RECIPES:
        table[f"llama-pp2-{recipe}"] = lambda r=recipe: trains_like_one_process(r, 1, 2)
        table[f"llama-dp2-{recipe}"] = lambda r=recipe: trains_like_one_process(r, 2, 1)
        table[f"llama-tp2-{recipe}"] = lambda r=recipe: trains_like_one_process(r, 1, 1, tp=2)
        table[f"llama-tp2-sp-{recipe}"] = lambda r=recipe: trains_like_one_process(
            r, 1, 1, tp=2, sequence_parallel=True)
        table[f"llama-dp2-zero3-{recipe}"] = lambda r=recipe: trains_like_one_process(
            r, 2, 1, zero=3)
    table["llama-pp2-tensorwise-bf16"] = lambda: trains_like_one_process(
        "tensorwise", 1, 2, torch.bfloat16)
    for recipe in RECIPES:  # peft's adapters over float8 base linears
        table[f"llama-pp2-lora-{recipe}"] = lambda r=recipe: trains_like_one_process(
            r, 1, 2, adapters=True)
    table["llama-tp2-lora-tensorwise"] = lambda: trains_like_one_process(
        "tensorwise", 1, 1, tp=2, adapters=True)  # TP's base layers and adapters
    # compiled blocks: AOT autograd's graphs run eagerly (dynamo traces the float8 casts);
    # inductor's fused kernels with MERAK_TEST_MATRIX=full
    table["llama-pp2-compile-rowwise"] = lambda: trains_like_one_process(
        "rowwise", 1, 2, compile_backend="aot_eager")
    if FULL:
        for recipe in RECIPES:
            table[f"llama-pp2-inductor-{recipe}"] = lambda r=recipe: trains_like_one_process(
                r, 1, 2, compile_backend="inductor")
    for recipe in RECIPES:  # context parallelism: ring (tensorwise), Ulysses (rowwise)
        mode = "ring" if recipe == "tensorwise" else "ulysses"
        table[f"llama-cp2-{mode}-{recipe}"] = lambda r=recipe, m=mode: context_parallel(r, m)
    table["llama-pp2-rowwise-recompute"] = lambda: trains_like_one_process(
        "rowwise", 1, 2, recompute=1.0)  # every block's forward run again before its backward
    table["llama-dp2-zero2-tensorwise"] = lambda: trains_like_one_process(
        "tensorwise", 2, 1, zero=2)  # gathered once a step, with the precomputed scales
    table["llama-tp2-twenty-steps"] = lambda: twenty_steps(1, 2, 1)
    return table


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
