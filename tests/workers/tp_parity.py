"""Tensor parallelism (alone and composed with dp and pp) against the single-process model:
meta build -> apply_tensor_parallel -> auto_split -> materialize own stage -> 1f1b interpreter,
3 SGD steps; the parity scenarios return the loss, every gradient (against this rank's slice of
the full gradient) and the final parameters next to the reference's (`Compared`), which
test_tensor_parallel compares; the same for families sharded by the plan inferred from their
blocks (test_tp_infer). The refusals of wrong plans, the dropout draws, the LoRA, generation
and host-object scenarios return what test_tensor_parallel and test_host_objects assert.
The 4- and 8-rank launches also run lora_parity.py's scenarios (LoRA through peft on TP
layouts) and generation_parity.py's (pipelined generation against HF generate); the 4-rank one
host_objects.py's (objects between ranks through host memory)."""

from __future__ import annotations

import os
import tempfile

import generation_parity
import host_objects
import lora_parity
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import Compared, GradSnapshot, run_scenarios
from hf_models import CustomMLP, batch
from safetensors.torch import save_file, save_model
from tp_models import HF_PLAN_FAMILIES, INFERRED, TP_FAMILIES, inferred_family, tp_batch

import merak
from merak.materialize.meta import materialize_

STEPS, MICROBATCHES, ROWS, LR, SEED = 3, 2, 2, 0.05, 4321


def _slice(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    spec = getattr(param, "tp_shard", None)
    return spec.take(full) if spec is not None else full


def parity(build, batch_fn, dp: int, tp: int, pp: int, plan_setup=None,
           from_checkpoint: bool = False, **tp_options) -> dict:
    ctx = merak.init(dp=dp, tp=tp, pp=pp)
    if plan_setup:
        plan_setup()
    with tempfile.TemporaryDirectory() as tmp:
        if from_checkpoint:  # a full HF-style checkpoint; each rank must load exactly its shard
            torch.manual_seed(SEED + 1)  # (save_pretrained writes on rank 0 only: each rank
            save_model(build(), os.path.join(tmp, "model.safetensors"))  # writes its own copy)
        torch.manual_seed(SEED)
        with merak.init_empty_weights():
            model = build()
        stage = merak.parallelize(model, batch_fn(0, ROWS), ctx,
                                  checkpoint=tmp if from_checkpoint else None, **tp_options)
    snapshot = GradSnapshot(stage)
    grads = snapshot.grads
    engine = merak.PipelineInterpreter(stage, ctx, torch.optim.SGD(stage.parameters(), lr=LR),
                                       num_microbatches=MICROBATCHES, schedule="1f1b",
                                       hooks=[snapshot])
    rows = ROWS * MICROBATCHES
    losses = []
    for step in range(STEPS):
        full = batch_fn(step, rows * dp)
        mine = {k: v[ctx.dp_rank * rows:(ctx.dp_rank + 1) * rows] for k, v in full.items()}
        losses.append(engine.train_step(mine))

    if from_checkpoint:
        torch.manual_seed(SEED + 1)
    else:
        torch.manual_seed(SEED)
    reference = build()
    params = dict(reference.named_parameters(remove_duplicate=False))
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    own = dict(stage.named_parameters())
    compared, ref_losses = Compared(), []
    for step in range(STEPS):
        out = reference(**batch_fn(step, rows * dp))
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        ref_losses.append(loss.item())
        for name, grad in grads[step].items():
            compared.grad(f"step {step} grad of {name}", grad,
                          _slice(own[name], params[name].grad))
        optimizer.step()
        optimizer.zero_grad()
    compared.value("losses", losses, ref_losses)
    for name, param in own.items():
        compared.value(f"{name} at the end", param, _slice(param, params[name].detach()))
    shards = [n for n, p in own.items() if getattr(p, "tp_shard", None) is not None]
    return compared.figures(params=len(own), params_without_grad=sorted(set(own) - set(grads[0])),
                            sharded_params=len(shards))


def family(name: str, dp: int, tp: int, pp: int, **tp_options):
    return lambda: parity(TP_FAMILIES[name], lambda s, r: tp_batch(name, s, r), dp, tp, pp,
                          **tp_options)


def custom_plan(tp: int):
    def setup():
        merak.set_tp_layer_lists(col_para_list=["fc1"], input_output_mapping=[(2, 1, "row")])
    return lambda: parity(lambda: CustomMLP(depth=4), lambda s, r: batch("mlp", s, r), 1, tp, 1,
                          plan_setup=setup)


def collectives(tp: int) -> dict:
    """The tp collectives (`all_gather_single` / `reduce_scatter_single` into one buffer)
    against the list all-gather + cat and the all-reduce + slice they replace, along every
    dimension, with their autograd conjugates."""
    from merak.tensor_parallel.layers.collectives import gather_sequence, reduce_scatter_sequence

    ctx = merak.init(dp=1, tp=tp, pp=1)
    group, rank = ctx.tp_group, ctx.tp_rank
    g, compared = torch.Generator().manual_seed(11 + rank), Compared()
    for dim in (0, 1, 2, -1, -2):
        shape = [3, 5, 2]
        shape[dim] = 2 * tp
        x = torch.randn(shape, generator=g, requires_grad=True)
        parts = [torch.empty_like(x) for _ in range(tp)]
        dist.all_gather(parts, x.detach(), group=group)
        gathered = gather_sequence(x, dim, group)
        compared.value(f"all-gather along {dim}", gathered, torch.cat(parts, dim))
        total = x.detach().clone()
        dist.all_reduce(total, group=group)
        scattered = reduce_scatter_sequence(x, dim, group)
        compared.value(f"reduce-scatter along {dim}", scattered, total.chunk(tp, dim)[rank])
        # backward: the gather's is a reduce-scatter, the reduce-scatter's an all-gather
        up = torch.randn(gathered.shape, generator=g)
        (gathered * up).sum().backward()
        summed = up.clone()
        dist.all_reduce(summed, group=group)
        compared.value(f"gather's backward along {dim}", x.grad, summed.chunk(tp, dim)[rank])
    return compared.figures()


def vocab_parallel_loss(tp: int) -> dict:
    ctx = merak.init(dp=1, tp=tp, pp=1)
    torch.manual_seed(SEED)
    logits = torch.randn(3, 5, 128, requires_grad=True)
    labels = torch.randint(0, 128, (3, 5))
    labels[0, :2] = -100
    shard = logits.detach().chunk(tp, dim=-1)[ctx.tp_rank].clone().requires_grad_()
    loss = merak.vocab_parallel_cross_entropy(shard, labels, ctx.tp_group)
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    expected.backward()
    compared = Compared()
    compared.value("vocab-parallel loss", loss, expected)
    compared.value("its gradient", shard.grad, logits.grad.chunk(tp, dim=-1)[ctx.tp_rank])
    return compared.figures()


def dropout_rng(tp: int) -> dict:
    """Whether random draws agree across TP ranks on replicated activations (GPT-2's dropout
    after the row-parallel projection) and differ between a column- and a row-parallel layer:
    ``{key}_alike`` for each draw."""
    import transformers as tf

    ctx = merak.init(dp=1, tp=tp, pp=1)
    torch.manual_seed(SEED)
    config = tf.GPT2Config(n_embd=64, n_layer=1, n_head=8, vocab_size=128, attn_pdrop=0.5,
                           resid_pdrop=0.5, embd_pdrop=0.0)
    with merak.init_empty_weights():
        model = tf.GPT2LMHeadModel(config)
    merak.apply_tensor_parallel(model, ctx)
    materialize_(model)
    seen = {}
    attn = model.transformer.h[0].attn
    # runs after merak's own hook on c_attn, which enters this rank's stream
    attn.c_attn.register_forward_hook(lambda m, a, o: seen.update(inside=torch.rand(16)))
    attn.register_forward_hook(lambda m, a, o: seen.update(replicated=o[0].detach(),
                                                           outside=torch.rand(16)))
    model.train()
    model(input_ids=torch.randint(0, 128, (2, 6)))
    gathered = {k: [torch.empty_like(v) for _ in range(tp)] for k, v in seen.items()}
    for k, v in seen.items():
        dist.all_gather(gathered[k], v.contiguous(), group=ctx.tp_group)
    return {f"{key}_alike": all(torch.equal(gathered[key][0], g) for g in gathered[key])
            for key in ("replicated", "outside", "inside")}


def checkpoint_shards(tp: int) -> dict:
    """A full HF safetensors file loads into each rank exactly its shard."""
    ctx = merak.init(dp=1, tp=tp, pp=1)
    torch.manual_seed(SEED)
    full = TP_FAMILIES["gpt2"]()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        state = {k: v.contiguous() for k, v in full.state_dict().items() if k != "lm_head.weight"}
        save_file(state, path)
        with merak.init_empty_weights():
            model = TP_FAMILIES["gpt2"]()
        merak.apply_tensor_parallel(model, ctx, parallel_vocab=True)
        materialize_(model, initialize=False)
        merak.load_safetensors_(model, path, aliases={"lm_head.weight": ["transformer.wte.weight"]})
    reference = dict(full.named_parameters(remove_duplicate=False))
    compared = Compared()
    for name, param in model.named_parameters(remove_duplicate=False):
        compared.value(name, param, _slice(param, reference[name].detach()))
    return compared.figures(tied=model.lm_head.weight is model.transformer.wte.weight,
                            total_params=sum(p.numel() for p in full.parameters()),
                            rank_params=sum(p.numel() for p in model.parameters()))


def _full_grad(param: torch.Tensor, group) -> torch.Tensor:
    """The whole gradient of `param` from every TP rank: partial gradients summed, shards
    gathered and put together with `ShardSpec.assemble`."""
    grad = param.grad
    if getattr(param, "tp_partial_grad", False):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
    spec = getattr(param, "tp_shard", None)
    if spec is None:
        return grad
    shards = [torch.empty_like(grad) for _ in range(spec.size)]
    dist.all_gather(shards, grad.contiguous(), group=group)
    return spec.assemble(shards)


def hf_plan_parity(name: str, tp: int) -> dict:
    """A family with no FAMILY_PLANS entry, sharded by its config's base_model_tp_plan (every
    transformers style it uses): loss (with MoE auxiliary loss) and every gradient, assembled
    from the shards, equal the unsharded model's. Eager (no pipeline split)."""
    ctx = merak.init(dp=1, tp=tp, pp=1)
    torch.manual_seed(SEED)
    with merak.init_empty_weights():
        model = HF_PLAN_FAMILIES[name]()
    merak.apply_tensor_parallel(model, ctx)
    plan_source = model.merak_tp.plan.source
    torch.manual_seed(SEED)
    materialize_(model)
    torch.manual_seed(SEED)
    reference = HF_PLAN_FAMILIES[name]()
    data = tp_batch(name, 0, ROWS)
    model.train()
    reference.train()
    loss = model(**data).loss
    loss.backward()
    expected = reference(**data).loss
    expected.backward()
    compared = Compared()
    compared.value("loss", loss.detach(), expected.detach())
    params = dict(reference.named_parameters())
    sharded, misshapen, stray_grads = 0, [], []
    for pname, param in model.named_parameters():
        sharded += getattr(param, "tp_shard", None) is not None
        if param.shape != _slice(param, params[pname]).shape:
            misshapen.append(pname)
            continue
        compared.value(f"{pname} (init)", param, _slice(param, params[pname].detach()))
        if params[pname].grad is None:
            if param.grad is not None:  # a gradient the unsharded model's parameter lacks
                stray_grads.append(pname)
            continue
        compared.grad(f"grad of {pname}", _full_grad(param, ctx.tp_group), params[pname].grad)
    return compared.figures(sharded_params=sharded, plan_source=plan_source,
                            misshapen=misshapen, stray_grads=stray_grads)


def inferred_parity(name: str, tp: int):
    """A family sharded by the plan inferred from its blocks (proven by merak.parallelize)."""
    return lambda: parity(inferred_family(name), lambda s, r: batch("llama", s, r), 1, tp, 1)


def planted_wrong_plans(tp: int) -> dict:
    """Wrong plans marked to be proven (check=True), for their test to see refused naming the
    module: BioGPT's row-parallel fc2 marked column (by merak.parallelize when the sharded model
    is traced, and by the proof itself: the sharded block does not run), and OpenAI-GPT's fused
    q/k/v c_attn split as one part, which runs but mixes q, k and v (the sharded block against
    the unsharded one). ``{family: {"module", "check", "source", "parallelize", "proof"}}``,
    the last two the refusals' messages (None where the plan went through)."""
    import dataclasses

    from merak.tensor_parallel.apply.infer import infer_plan
    from merak.tensor_parallel.tracing.proof import PlanRefused, prove_plan

    ctx = merak.init(dp=1, tp=tp, pp=1)
    seen = {}
    for name, wrong, module in (
            ("biogpt", lambda p: dataclasses.replace(
                p, column=p.column + ("biogpt.layers.*.fc2",),
                row=tuple(r for r in p.row if not r.endswith("fc2"))), "fc2"),
            ("openai-gpt", lambda p: dataclasses.replace(p, fused={}), "attn.c_attn")):
        build = inferred_family(name)
        with merak.init_empty_weights():
            model = build()
        plan = infer_plan(model, tp)
        seen[name] = {"module": module, "check": plan.check, "source": plan.source,
                      "parallelize": None, "proof": None}
        try:
            merak.parallelize(model, batch("llama", 0, ROWS), ctx, plan=wrong(plan))
        except PlanRefused as error:
            seen[name]["parallelize"] = str(error)
        # the proof itself, on the materialized sharded model (no split traced first)
        with merak.init_empty_weights():
            model = build()
        merak.apply_tensor_parallel(model, ctx, plan=wrong(plan))
        materialize_(model)
        try:
            prove_plan(model, list(model.merak_tp.examples), ctx)
        except PlanRefused as error:
            seen[name]["proof"] = str(error)
    return seen


TP4_FAMILIES = ("llama", "gpt2")
SCENARIOS = {
    2: {**{f"tp2-{name}": family(name, 1, 2, 1) for name in TP_FAMILIES},
        "tp2-llama-parallel-vocab": family("llama", 1, 2, 1, parallel_vocab=True),
        "tp2-gpt2-parallel-vocab": family("gpt2", 1, 2, 1, parallel_vocab=True),
        "tp2-llama-sequence-parallel": family("llama", 1, 2, 1, sequence_parallel=True),
        "tp2-custom-set_tp_layer_lists": custom_plan(2),
        "tp2-vocab-parallel-cross-entropy": lambda: vocab_parallel_loss(2),
        "tp2-collectives": lambda: collectives(2),
        "tp2-dropout-rng": lambda: dropout_rng(2),
        "tp2-checkpoint-shards": lambda: checkpoint_shards(2),
        **{f"tp2-hf-plan-{name}": (lambda n=name: hf_plan_parity(n, 2))
           for name in HF_PLAN_FAMILIES},
        "tp2-hf-plan-olmo2-pipeline": lambda: parity(
            HF_PLAN_FAMILIES["olmo2"], lambda s, r: tp_batch("olmo2", s, r), 1, 2, 1),
        **{f"tp2-inferred-{name}": inferred_parity(name, 2) for name in INFERRED},
        "tp2-planted-wrong-plans-refused": lambda: planted_wrong_plans(2)},
    # tp=4 on the families whose 4-way split differs in kind (grouped KV heads, GPT-2's fused
    # qkv); every family runs at tp=2 above (the suite's time budget)
    4: {**{f"tp4-{name}": family(name, 1, 4, 1) for name in TP4_FAMILIES},
        "tp2-pp2-llama-sequence-parallel": family("llama", 1, 2, 2, sequence_parallel=True),
        "tp4-vocab-parallel-cross-entropy": lambda: vocab_parallel_loss(4),
        "tp4-collectives": lambda: collectives(4)},
    # dp2 x tp2 x pp2 Llama trains through MerakTrainer in test_trainer (and below with LoRA
    # and generation); every gradient is compared here for BERT and GPT-2
    8: {"dp2-tp2-pp2-bert": family("bert", 2, 2, 2),
        "dp2-tp2-pp2-gpt2-from-checkpoint": family("gpt2", 2, 2, 2, parallel_vocab=True,
                                                   from_checkpoint=True)},
}


for _size in (4, 8):  # LoRA and generation on TP layouts, in the same launches
    SCENARIOS[_size].update(lora_parity.SCENARIOS[_size])
    SCENARIOS[_size].update(generation_parity.SCENARIOS[_size])
SCENARIOS[4].update(host_objects.SCENARIOS[4])  # objects through host memory


# the scenarios whose figures are not a comparison with a reference (their own tests)
DROPOUT, WRONG_PLANS = "tp2-dropout-rng", "tp2-planted-wrong-plans-refused"
HOST_OBJECTS = {name for size in host_objects.SCENARIOS for name in host_objects.SCENARIOS[size]}
GENERATION = {name for size in generation_parity.SCENARIOS
              for name in generation_parity.SCENARIOS[size]}


def scenario_names(world_size: int) -> list[str]:
    return list(SCENARIOS[world_size])


def scenarios(world_size: int) -> dict:
    return SCENARIOS[world_size]


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
