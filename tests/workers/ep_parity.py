"""Expert parallelism against the single-process model (see test_expert_parallel): a tiny
Qwen3-MoE and Mixtral (2 layers, hidden 32, 4 experts, top-2, router load-balancing loss on),
each replica reading its own padded rows.

``hf-*``: the HF model itself with its experts sharded (`shard_experts`), one forward and
backward: each rank's loss and load-balancing loss equal the model's on the same rows, its
non-expert gradients the model's on those rows, and the ep group's expert gradients, gathered,
the model's summed over the group's rows. ``engine-*``: the real engine (`build_engine`,
`PipelineInterpreter`), 3 optimizer steps: each step's loss (mean over replicas and
micro-batches), every gradient at the optimizer step and every parameter after training equal
the single-process model trained on the mean of the same micro-batch losses; each rank holds
1/ep of every experts tensor."""

from __future__ import annotations

import copy
import math
import os

import torch
import torch.distributed as dist
import transformers as tf
from common import Compared, GradSnapshot, out_dir

import merak
from merak.checkpoint.sharded import shard_spec
from merak.coverage.shrink import small_config
from merak.data_parallel.shards import is_sharded, local, whole
from merak.data_parallel.zero1 import local_optimizer
from merak.engine.assemble import build_engine
from merak.engine.options import EngineOptions, HookOptions, PrecisionOptions
from merak.expert_parallel import dispatch, experts_modules, shard_experts
from merak.runtime.options import RuntimeOptions

VOCAB, SEQ, SEED, STEPS, MICRO, ROWS_PER_MICRO = 128, 12, 11, 3, 2, 2
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "output_router_logits": True, "router_aux_loss_coef": 0.1, "num_experts_per_tok": 2}
CONFIGS = {
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**COMMON, head_dim=8, num_experts=4,
                                           moe_intermediate_size=16),
    "mixtral": lambda: tf.MixtralConfig(**{**COMMON, "intermediate_size": 16},
                                        num_local_experts=4),
}
# more families, at engine parity (dp2 ep2, SGD) only: the coverage's small
# configs (4 layers, 4 experts, top-2; DeepSeek-V3's first layer dense, with shared experts and
# group-limited routing; GPT-OSS's experts with biases), load-balancing loss on where they have
# one; Llama-4: a block outside the experts interface (merak/expert_parallel/dense_moe.py)
MORE_FAMILIES = ("olmoe", "deepseek_v3", "gpt_oss", "llama4_text")
FULL = os.environ.get("MERAK_TEST_MATRIX") == "full"  # the wider grid
OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
              "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}


def _config(family: str):
    if family in CONFIGS:
        return CONFIGS[family]()
    config = small_config(family)
    config.output_router_logits = True
    if getattr(config, "router_aux_loss_coef", None) is not None:
        config.router_aux_loss_coef = 0.1
    return config


def _reference(family: str):
    torch.manual_seed(SEED)
    return tf.AutoModelForCausalLM.from_config(_config(family))


def rows(step: int, first: int, count: int) -> dict[str, torch.Tensor]:
    """Global rows ``first .. first+count-1`` of `step`: right-padded to SEQ with lengths 5..12,
    attention_mask 0 and labels -100 on the pads."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(1, VOCAB, (first + count, SEQ), generator=g)[first:]
    lengths = torch.tensor([5 + (3 * r + step) % (SEQ - 4) for r in range(first, first + count)])
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _is_expert(name: str, model_experts: set[str]) -> bool:
    return name.rsplit(".", 1)[0] in model_experts


def _max_diff(compared: Compared) -> float:
    diffs = [abs(a - e) for a, e in compared.floats.values() if isinstance(a, float)]
    diffs += [(a - e).abs().max().item() for kind in compared.tensors.values()
              for a, e in kind.values() if a.numel()]
    return max(diffs, default=0.0)


def _skew(model) -> None:
    """Every routed pair to experts 0 and 1 (ep rank 0's): the other ranks receive nothing."""
    def hook(module, args, output):
        logits, scores, indices = output
        return logits, scores, indices % 2

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(hook)


def hf_direct(family: str, skewed: bool = False, inner: str | None = None) -> dict:
    """One forward and backward of the HF model with sharded experts, per replica's rows;
    `skewed`: every pair routed to ep rank 0's experts (`_skew`); `inner`: the experts
    implementation the model runs (default: transformers' choice, grouped_mm), which then
    runs each rank's local experts."""
    ctx = merak.init(dp=dist.get_world_size(), tp=1, pp=1, ep=2)
    _RECEIVED.clear()
    reference = _reference(family)
    if inner is not None:
        reference.config._experts_implementation = inner
    model = copy.deepcopy(reference)
    kept = shard_experts(model, ctx)
    if skewed:
        for m in (model, reference):
            _skew(m)
    experts = set(kept)
    group_ranks = dist.get_process_group_ranks(ctx.ep_group)
    rows_per = 4
    mine = rows(0, ctx.dp_rank * rows_per, rows_per)
    out = model(**mine)
    out.loss.backward()
    compared = Compared()
    expected = reference(**mine)
    compared.value("loss", out.loss.item(), expected.loss.item())
    compared.value("aux_loss", out.aux_loss.item(), expected.aux_loss.item())
    expected.loss.backward()
    mine_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
    reference.zero_grad()
    summed = {}  # the expert gradients of the model summed over the ep group's rows
    for rank in group_ranks:
        dp_rank = rank  # (pp = tp = cp = 1)
        reference(**rows(0, dp_rank * rows_per, rows_per)).loss.backward()
    summed = {n: p.grad for n, p in reference.named_parameters()}
    for name, param in model.named_parameters():
        if _is_expert(name, experts):
            gathered = [torch.empty_like(param.grad) for _ in group_ranks]
            dist.all_gather(gathered, param.grad.contiguous(), group=ctx.ep_group)
            compared.grad(f"gathered grad of {name}", torch.cat(gathered), summed[name])
        else:
            compared.grad(f"grad of {name}", param.grad, mine_grads[name])
    counts = _expert_counts(model, reference, experts)
    received = [int(t) for t in _RECEIVED]
    _RECEIVED.clear()
    return compared.figures(max_abs_diff=_max_diff(compared), expert_counts=counts, ep=ctx.ep,
                            kept=kept, received=received,
                            inner=next(iter(experts_modules(model).values())).merak_ep.inner)


_RECEIVED: list[int] = []  # pairs the local experts of this rank received, per layer call


def _counting(inner_forward):
    def chosen(module, name):
        run = inner_forward(module, name)

        def counted(arrived, *args):
            _RECEIVED.append(arrived.shape[0])
            return run(arrived, *args)
        return counted
    return chosen


dispatch._inner_forward = _counting(dispatch._inner_forward)


def _expert_counts(model, reference, experts: set[str]) -> dict[str, list[int]]:
    """Per experts tensor: [this rank's element count, the layer's]."""
    full = dict(reference.named_parameters())
    return {n: [p.numel(), full[n].numel()] for n, p in model.named_parameters()
            if _is_expert(n, experts)}


def _loaded(family: str) -> torch.nn.Module:
    """The model with every weight moved off its initialization (what a checkpoint holds)."""
    model = _reference(family)
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=g))
    return model


def engine(family: str, dp: int, pp: int, optimizer: str, clip: float = 0.0, ep: int = 2,
           load: bool = False, zero: int = 0, tp: int = 1) -> dict:
    """`clip` > 0: gradients clipped to that global norm (`max_grad_norm`), as
    `clip_grad_norm_` clips the single-process model's. `load`: the engine loads its stage
    from the `save_pretrained` files of `_loaded` (Mixtral's: per-expert tensors, merged on
    load), then keeps its experts. `zero`: the ZeRO stage (1: the experts' optimizer state
    over the edp group, the rest over the replicas; 2, 3: FSDP2, the experts sharded over the
    edp group, the rest over the replicas; gradients and parameters compared whole). `tp`:
    tensor parallelism too (the family's plan; Qwen3-MoE's and Mixtral's split every expert's
    intermediate dim)."""
    ctx = merak.init(dp=dp, tp=tp, pp=pp, ep=ep)
    rows_per = MICRO * ROWS_PER_MICRO
    checkpoint = None
    if load:  # (rank 0 writes it: transformers saves on the main process only)
        checkpoint = out_dir() / f"checkpoint-{family}"
        if ctx.rank == 0:
            _loaded(family).save_pretrained(checkpoint)
        dist.barrier()
    with merak.init_empty_weights():
        model = _reference(family)  # (seeded: materialized as the reference initializes)
    options = EngineOptions(pipeline=RuntimeOptions(num_microbatches=MICRO),
                            hooks=HookOptions(max_grad_norm=clip),
                            precision=PrecisionOptions(zero_stage=zero))
    built = build_engine(model, rows(0, 0, ROWS_PER_MICRO), ctx, options,
                         make_optimizer=lambda stage: OPTIMIZERS[optimizer](stage.parameters()),
                         checkpoint=checkpoint)
    norms = []
    built.interpreter.hooks.append(_NormProbe(built.clipper, norms))
    stage = built.stage
    snapshot = GradSnapshot(stage)  # (ZeRO-2/3: gathered whole)
    built.interpreter.hooks.append(snapshot)
    losses = [built.interpreter.train_step(rows(step, ctx.dp_rank * rows_per, rows_per))
              for step in range(STEPS)]
    reference = _loaded(family) if load else _reference(family)
    ref_opt = OPTIMIZERS[optimizer](reference.parameters())
    ref_losses, ref_grads, ref_norms = [], [], []
    for step in range(STEPS):
        micro = [rows(step, d * rows_per + m * ROWS_PER_MICRO, ROWS_PER_MICRO)
                 for d in range(dp) for m in range(MICRO)]
        loss = sum(reference(**b).loss for b in micro) / len(micro)
        loss.backward()
        ref_losses.append(loss.item())
        if clip > 0:
            ref_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip).item())
        ref_grads.append({n: p.grad.clone() for n, p in reference.named_parameters()})
        ref_opt.step()
        ref_opt.zero_grad()
    experts = set(experts_modules(stage))
    specs = {n: shard_spec(p) for n, p in stage.named_parameters()}

    def mine(name: str, tensor: torch.Tensor) -> torch.Tensor:  # this rank's experts / tp cut
        spec = specs[name]
        return tensor if spec is None else spec.take(tensor)

    compared = Compared()
    compared.value("losses", losses, ref_losses)
    if clip > 0:
        compared.value("gradient norms before clipping", norms, ref_norms)
    for step, grads in enumerate(snapshot.grads):
        for name, grad in grads.items():
            compared.grad(f"step {step} grad of {name}", grad, mine(name, ref_grads[step][name]))
    final = dict(reference.named_parameters())
    for name, param in stage.named_parameters():  # (ZeRO-2/3: gathered, every rank alike)
        compared.value(f"{name} after {STEPS} steps", whole(param.detach()),
                       mine(name, final[name]))
    params = list(stage.parameters())
    return compared.figures(max_abs_diff=_max_diff(compared), ep=ctx.ep, tp=ctx.tp,
                            optimizer=type(built.optimizer).__name__,
                            # parameters whose optimizer state this rank holds: (dense, experts)
                            states=[sum(p in local_optimizer(built.optimizer).state
                                        for p in params if getattr(p, "expert_parallel",
                                                                   False) == expert)
                                    for expert in (False, True)],
                            params=[sum(not getattr(p, "expert_parallel", False) for p in params),
                                    sum(getattr(p, "expert_parallel", False) for p in params)],
                            expert_counts=_expert_counts(stage, reference, experts),
                            experts_modules=sorted(experts),
                            zero_groups=_zero_groups(stage),
                            params_without_grad=sorted(set(dict(stage.named_parameters()))
                                                       - set(snapshot.grads[0])))


def _zero_groups(stage) -> dict[str, list[int]]:
    """ZeRO-2/3: ``{"dense" | "experts": the sizes of the groups sharding them}``, after
    checking this rank holds its 1/size of each such parameter (empty without ZeRO-2/3)."""
    out: dict[str, set] = {}
    for name, param in stage.named_parameters():
        if is_sharded(param):
            size, held = param.device_mesh.size(), local(param).numel()
            assert held <= -(-param.shape[0] // size) * math.prod(param.shape[1:]), (name, held)
            kind = "experts" if getattr(param, "expert_parallel", False) else "dense"
            out.setdefault(kind, set()).add(size)
    return {k: sorted(v) for k, v in out.items()}


class _NormProbe(merak.InstructionHook):
    """The clipper's global norm of each step (it ran just before this hook)."""

    def __init__(self, clipper, norms: list[float]):
        self.clipper, self.norms = clipper, norms

    def on_instruction_begin(self, name, action):
        if name == "optimizer_step":
            self.norms.append(self.clipper.last_norm)


def refusals() -> None:
    """ep not dividing the experts, and the engine options ep does not combine with yet."""
    from merak import rules
    from merak.rules import NotSupportedYetError

    ctx = merak.init(dp=dist.get_world_size(), tp=1, pp=1, ep=2)
    model = tf.AutoModelForCausalLM.from_config(tf.Qwen3MoeConfig(
        **{**COMMON, "num_experts_per_tok": 1}, head_dim=8, num_experts=3,
        moe_intermediate_size=16))
    before = [p.shape for p in model.parameters()]
    try:
        shard_experts(model, ctx)
    except ValueError as error:
        assert "3 experts" in str(error) and "ep=2" in str(error), error
    else:
        raise AssertionError("3 experts sharded over ep=2")
    assert [p.shape for p in model.parameters()] == before, "a refused shard changed the model"
    for zero in (2, 3):  # ZeRO-2/3 compose with ep (the experts sharded over edp)
        assert rules.refusal(EngineOptions(precision=PrecisionOptions(
            zero_stage=zero)).choices(ctx)) is None
    try:  # made after merak.init(ep=2): the rules read its ep
        merak.MerakArguments(output_dir=str(out_dir() / "trainer"), save_strategy="no",
                             report_to=[], auto_find_batch_size=True)
    except NotSupportedYetError as error:
        assert "auto_find_batch_size=True with expert parallelism (ep=2)" in str(error), error
    else:
        raise AssertionError("MerakArguments took auto_find_batch_size=True with ep=2")


def layout() -> None:
    """ep carved from the replicas: dp4 ep2 -> ep groups [0,1],[2,3], edp [0,2],[1,3];
    dp2 pp2 ep2 -> ep groups [0,1] and [2,3] (one per stage), edp of one rank."""
    ranks = dist.get_process_group_ranks
    ctx = merak.init(dp=4, tp=1, pp=1, ep=2)
    rank = ctx.rank
    assert ctx.ep_rank == rank % 2 and ranks(ctx.ep_group) == [rank - rank % 2, rank - rank % 2 + 1]
    assert ranks(ctx.edp_group) == [rank % 2, rank % 2 + 2] and "ep=" in ctx.describe()
    ctx = merak.init(dp=2, tp=1, pp=2, ep=2)
    assert ranks(ctx.ep_group) == ([0, 1] if rank < 2 else [2, 3])
    assert ranks(ctx.edp_group) == [rank]
    ctx = merak.init(dp=1, tp=2, pp=1, cp=2, ep=2)  # ep over cp: tp innermost
    assert ranks(ctx.ep_group) == [rank % 2, rank % 2 + 2] and ctx.ep_rank == rank // 2
    ctx = merak.init(dp=4, tp=1, pp=1)
    assert ctx.ep == 1 and ctx.ep_group is None and ctx.edp_group is ctx.replica_group


def scenarios(world_size: int) -> dict:
    out = {}
    for family in CONFIGS:
        out[f"hf-{family}-dp{world_size}-ep2"] = lambda f=family: hf_direct(f)
    out[f"hf-qwen3_moe-dp{world_size}-ep2-skewed"] = lambda: hf_direct("qwen3_moe", True)
    if world_size == 2:
        for inner in ("eager", "batched_mm"):
            out[f"hf-qwen3_moe-dp2-ep2-{inner}"] = lambda i=inner: hf_direct("qwen3_moe", inner=i)
        for family in CONFIGS:
            for opt in OPTIMIZERS:
                out[f"engine-{family}-dp2-ep2-{opt}"] = lambda f=family, o=opt: engine(f, 2, 1, o)
        out["engine-qwen3_moe-dp2-ep2-sgd-clip"] = lambda: engine("qwen3_moe", 2, 1, "sgd", 0.5)
        # loaded from save_pretrained: Qwen3-MoE; Llama-4's block (its experts called as a
        # module), which no trainer run covers; the families the ep trainer runs load and
        # train at dp2 ep2 there (tests/workers/ep_trainer.py), their engine runs here
        # with the full matrix
        out["engine-qwen3_moe-dp2-ep2-sgd-loaded"] = lambda: engine(
            "qwen3_moe", 2, 1, "sgd", load=True)
        out["engine-llama4_text-dp2-ep2-sgd"] = lambda: engine("llama4_text", 2, 1, "sgd")
        if FULL:
            out["engine-mixtral-dp2-ep2-sgd-loaded"] = lambda: engine(
                "mixtral", 2, 1, "sgd", load=True)
            for family in MORE_FAMILIES[:-1]:
                out[f"engine-{family}-dp2-ep2-sgd"] = lambda f=family: engine(f, 2, 1, "sgd")
            # ZeRO-3 for Mixtral, and for Llama-4's block (its experts called as a module)
            out["engine-mixtral-dp2-ep2-adamw-zero3"] = lambda: engine("mixtral", 2, 1, "adamw",
                                                                       zero=3)
            out["engine-llama4_text-dp2-ep2-sgd-zero3"] = lambda: engine("llama4_text", 2, 1,
                                                                         "sgd", zero=3)
        # ZeRO-2/3: the experts sharded over edp groups of one rank, the rest over the 2
        for zero in (2, 3):
            out[f"engine-qwen3_moe-dp2-ep2-adamw-zero{zero}"] = lambda z=zero: engine(
                "qwen3_moe", 2, 1, "adamw", zero=z)
        out["refusals"] = refusals
    if world_size == 4:
        out["engine-qwen3_moe-dp4-ep2-sgd"] = lambda: engine("qwen3_moe", 4, 1, "sgd")
        out["engine-qwen3_moe-dp2-ep2-pp2-sgd"] = lambda: engine("qwen3_moe", 2, 2, "sgd")
        out["engine-qwen3_moe-dp4-ep2-sgd-clip"] = lambda: engine("qwen3_moe", 4, 1, "sgd", 0.5)
        # one expert per rank, an ep group of 4, edp groups of one rank
        out["engine-qwen3_moe-dp4-ep4-adamw"] = lambda: engine("qwen3_moe", 4, 1, "adamw", ep=4)
        # ZeRO-1: the experts' AdamW state over edp groups of 2, the rest over the 4 replicas
        out["engine-qwen3_moe-dp4-ep2-adamw-zero1"] = lambda: engine("qwen3_moe", 4, 1, "adamw",
                                                                     zero=1)
        # ZeRO-2/3: the experts sharded over edp groups of 2, the rest over the 4 replicas;
        # the global norm counts each shard once
        out["engine-qwen3_moe-dp4-ep2-adamw-zero2"] = lambda: engine("qwen3_moe", 4, 1, "adamw",
                                                                     zero=2)
        out["engine-qwen3_moe-dp4-ep2-sgd-clip-zero3"] = lambda: engine(
            "qwen3_moe", 4, 1, "sgd", 0.5, zero=3)
        if FULL:  # ZeRO-2/3 with tp too, and across the pipeline stages
            out["engine-qwen3_moe-dp2-ep2-tp2-adamw-zero3"] = lambda: engine(
                "qwen3_moe", 2, 1, "adamw", tp=2, zero=3)
            out["engine-qwen3_moe-dp2-ep2-pp2-sgd-zero2"] = lambda: engine(
                "qwen3_moe", 2, 2, "sgd", zero=2)
        # tp x ep: tp rank t of each replica exchanges tokens with tp rank t of the others;
        # Qwen3-MoE's and Mixtral's plans split each expert over tp too, GPT-OSS's inferred
        # plan keeps its experts (and their biases) whole on the tp ranks
        out["engine-qwen3_moe-dp2-ep2-tp2-adamw"] = lambda: engine("qwen3_moe", 2, 1, "adamw",
                                                                   tp=2)
        out["engine-mixtral-dp2-ep2-tp2-sgd"] = lambda: engine("mixtral", 2, 1, "sgd", tp=2)
        out["engine-qwen3_moe-dp2-ep2-tp2-sgd-clip"] = lambda: engine("qwen3_moe", 2, 1, "sgd",
                                                                      0.5, tp=2)
        out["engine-gpt_oss-dp2-ep2-tp2-sgd"] = lambda: engine("gpt_oss", 2, 1, "sgd", tp=2)
        out["layout"] = layout
    return out


def scenario_names(world_size: int) -> list[str]:
    return list(scenarios(world_size))


SELF_CHECKED = ("refusals", "layout")


if __name__ == "__main__":
    from common import run_scenarios

    run_scenarios(scenarios(int(__import__("os").environ["WORLD_SIZE"])))
