"""Expert parallelism composed with the engine's other options, against the single-process
model (see test_expert_parallel_compose): a tiny 4-layer Qwen3-MoE (ep_parity's config, 4
experts, top-2, load-balancing loss on) at dp2 ep2, each replica reading its own padded rows,
2 SGD steps (STEPS) of 2 micro-batches through `build_engine`:

- every pipeline schedule at pp2 (4 ranks): interleaved 1F1B over 2 chunks a rank, ZB-V and
  DualPipeV (2 stages a rank in a V, the backward split into input and weight halves), ZB-H1
  and GPipe; each rank of an ep group runs the same program (the same stage of another
  replica), so the MoE layers' all-to-alls meet in one order;
- recomputation (every block's forward rerun, its all-to-alls with it; in the recompute action
  or inside the backward), `torch.compile` of the blocks, bf16 autocast (against the model
  under the same autocast), LoRA adapters on the attention (against peft's model).

Each step's loss, every gradient at the optimizer step and every parameter after training
(expert tensors against this rank's slice) are returned next to the reference's."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
import transformers as tf
from common import Compared, GradSnapshot
from ep_parity import COMMON, MICRO, ROWS_PER_MICRO, SEED, _expert_counts, _max_diff, rows
from peft import LoraConfig, get_peft_model

import merak
from merak import lora
from merak.checkpoint.sharded import shard_spec
from merak.engine.assemble import build_engine
from merak.engine.options import CompileOptions, EngineOptions, PrecisionOptions
from merak.expert_parallel import exchange, experts_modules
from merak.runtime.options import RuntimeOptions

LR, STEPS = 0.1, 2
FULL = os.environ.get("MERAK_TEST_MATRIX") == "full"  # the wider grid
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _model(layers: int) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return tf.AutoModelForCausalLM.from_config(tf.Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": layers}, head_dim=8, num_experts=4,
        moe_intermediate_size=16))


class _Exchanges:
    """Every token all-to-all of this rank (`merak.expert_parallel.exchange`: forward, its
    rerun, backward) as ``[rows sent to each ep rank, rows received from each]``, so the test
    can check that the i-th exchange of every rank of an ep group is the same collective."""

    def __init__(self):
        self.calls: list[list[list[int]]] = []
        self.real = dist.all_to_all_single

    def __call__(self, output, input, output_split_sizes=None, input_split_sizes=None,
                 group=None):
        if input_split_sizes is not None:  # (the counts' exchange has none)
            self.calls.append([list(input_split_sizes), list(output_split_sizes)])
        return self.real(output, input, output_split_sizes, input_split_sizes, group=group)


def _adapters(model: torch.nn.Module, wrap) -> torch.nn.Module:
    return wrap(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                  target_modules=ATTENTION, task_type="CAUSAL_LM"))


def composed(pp: int, schedule: str = "1f1b", chunks: int = 1, recompute: float = 0.0,
             in_backward: bool = False, compile_backend: str | None = None,
             autocast: torch.dtype | None = None, adapters: bool = False, ep: int = 2) -> dict:
    """dp2 ep2 at `pp`, the engine built with these options; the figures next to the
    single-process model's (under the same `autocast`; peft's with `adapters`: LoRA on the
    attention projections, B drawn non-zero so the base weights' gradients flow through it)."""
    ctx = merak.init(dp=2, tp=1, pp=pp, ep=ep)
    rows_per = MICRO * ROWS_PER_MICRO
    layers = 2 * pp  # 4 at pp2: a layer for each of the 4 stages of 2 chunks a rank
    with merak.init_empty_weights():
        model = _model(layers)
    if adapters:
        model = _adapters(model, lora.wrap)
    options = EngineOptions(
        pipeline=RuntimeOptions(schedule=schedule, num_microbatches=MICRO,
                                num_model_chunks=chunks, recompute_ratio=recompute,
                                recompute_in_backward=in_backward),
        precision=PrecisionOptions(autocast_dtype=autocast),
        compile=CompileOptions(enabled=compile_backend is not None, backend=compile_backend))
    built = build_engine(model, rows(0, 0, ROWS_PER_MICRO), ctx, options,
                         make_optimizer=lambda stage: torch.optim.SGD(
                             [p for p in stage.parameters() if p.requires_grad], lr=LR))
    stage = built.stage
    exchanges = _Exchanges()
    snapshot = GradSnapshot(stage)
    built.interpreter.hooks.append(snapshot)
    exchange.dist = SimpleNamespace(all_to_all_single=exchanges)
    losses, per_step = [], []
    try:
        for step in range(STEPS):
            before = len(exchanges.calls)
            losses.append(built.interpreter.train_step(rows(step, ctx.dp_rank * rows_per,
                                                            rows_per)))
            per_step.append(len(exchanges.calls) - before)
    finally:
        exchange.dist = dist

    reference = _model(layers)
    if adapters:
        reference = _adapters(reference, get_peft_model).get_base_model()
    trainable = [p for p in reference.parameters() if p.requires_grad]
    ref_opt = torch.optim.SGD(trainable, lr=LR)
    ref_losses, ref_grads = [], []
    for step in range(STEPS):
        micro = [rows(step, d * rows_per + m * ROWS_PER_MICRO, ROWS_PER_MICRO)
                 for d in range(2) for m in range(MICRO)]
        with torch.autocast("cpu", autocast, enabled=autocast is not None):
            loss = sum(reference(**b).loss for b in micro) / len(micro)
        loss.backward()
        ref_losses.append(loss.item())
        ref_grads.append({n: p.grad.clone() for n, p in reference.named_parameters()
                          if p.grad is not None})
        ref_opt.step()
        ref_opt.zero_grad()
    specs = {n: shard_spec(p) for n, p in stage.named_parameters()}

    def mine(name: str, tensor: torch.Tensor) -> torch.Tensor:  # this rank's experts
        return tensor if specs[name] is None else specs[name].take(tensor)

    compared = Compared()
    compared.value("losses", losses, ref_losses)
    for step, grads in enumerate(snapshot.grads):
        for name, grad in grads.items():
            compared.grad(f"step {step} grad of {name}", grad, mine(name, ref_grads[step][name]))
    final = dict(reference.named_parameters())
    for name, param in stage.named_parameters():
        compared.value(f"{name} after {STEPS} steps", param.detach(), mine(name, final[name]))
    experts = set(experts_modules(stage))
    own = dict(stage.named_parameters())
    return compared.figures(
        max_abs_diff=_max_diff(compared), rank=ctx.rank, ep_rank=ctx.ep_rank,
        last_stage=ctx.pp_rank == ctx.pp - 1,
        expert_counts=_expert_counts(stage, reference, experts),
        experts_modules=sorted(experts), exchanges=exchanges.calls,
        exchanges_per_step=per_step,
        ep_group=dist.get_process_group_ranks(ctx.ep_group) if ep > 1 else [ctx.rank],
        with_grad=sorted(snapshot.grads[0]),
        trainable=sorted(n for n, p in own.items() if p.requires_grad),
        reference_trainable=sorted(n for n, p in final.items() if p.requires_grad and n in own))


def scenarios(world_size: int) -> dict:
    out = {}
    if world_size == 2:
        # compiled blocks rerun by recomputation (each rerun repeats its all-to-alls); dynamo
        # alone here (graph breaks at the host-read split sizes), AOT autograd too in the full
        # matrix (7 s more on 2 shared cores)
        out["compose-dp2-ep2-compile-recompute"] = lambda: composed(
            1, recompute=1.0, compile_backend="eager")
        out["compose-dp2-ep2-bf16"] = lambda: composed(1, autocast=torch.bfloat16)
        out["compose-dp2-ep1-bf16"] = lambda: composed(1, autocast=torch.bfloat16, ep=1)
        out["compose-dp2-ep2-lora"] = lambda: composed(1, adapters=True)
        if FULL:
            out["compose-dp2-ep2-recompute"] = lambda: composed(1, recompute=1.0)
            out["compose-dp2-ep2-recompute-in-backward"] = lambda: composed(
                1, recompute=1.0, in_backward=True)
            out["compose-dp2-ep2-compile"] = lambda: composed(1, compile_backend="aot_eager")
            out["compose-dp2-ep2-lora-recompute"] = lambda: composed(
                1, adapters=True, recompute=1.0)
    if world_size == 4:  # 2 stages a rank: interleaved; a V with a split backward, rerun
        out["compose-dp2-ep2-pp2-interleaved_1f1b"] = lambda: composed(
            2, "interleaved_1f1b", chunks=2)
        out["compose-dp2-ep2-pp2-dualpipev-recompute"] = lambda: composed(
            2, "dualpipev", recompute=1.0)
        if FULL:  # every other schedule, with and without recomputation
            for name in ("zero_bubble", "ds_default", "dualpipev", "zbv"):
                out[f"compose-dp2-ep2-pp2-{name}"] = lambda n=name: composed(2, n)
            for name in ("pre_recompute_1f1b", "last_no_recompute_1f1b", "shifted_critical_path",
                         "zbv", "interleaved_1f1b"):
                out[f"compose-dp2-ep2-pp2-{name}-recompute"] = lambda n=name: composed(
                    2, n, chunks=2 if n == "interleaved_1f1b" else 1, recompute=1.0)
            out["compose-dp2-ep2-pp2-interleaved_1f1b-bf16"] = lambda: composed(
                2, "interleaved_1f1b", chunks=2, autocast=torch.bfloat16)
            out["compose-dp2-ep1-pp2-interleaved_1f1b-bf16"] = lambda: composed(
                2, "interleaved_1f1b", chunks=2, autocast=torch.bfloat16, ep=1)
    return out


def scenario_names(world_size: int) -> list[str]:
    return list(scenarios(world_size))


if __name__ == "__main__":
    from common import run_scenarios

    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
