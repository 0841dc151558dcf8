"""Context parallelism against the single-process model (see test_context_parallel): a tiny
Llama and Qwen2, each rank holding its load-balanced share of every row (`split_batch`), the
model's attention wrapped through transformers' registry (Ulysses or ring, around eager or
sdpa); the parity scenarios return the summed loss and every gradient (summed over the cp
ranks, which hold the same weights) next to the single-process model's (`Compared`), which
test_context_parallel compares; the refusals and the layout return what it checks. cp is the world
size (2 or 4)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import transformers as tf
from common import Compared
from tp_models import ATTN

import merak
from merak.context_parallel import enable_context_parallel, split_batch

ROWS, SEQ, VOCAB, SEED = 2, 24, 128, 7
FAMILIES = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}


def _models(family: str, inner: str, **overrides):
    config = FAMILIES[family](**{**ATTN, "vocab_size": VOCAB, **overrides})
    torch.manual_seed(SEED)
    reference = tf.AutoModelForCausalLM.from_config(config, attn_implementation=inner)
    # a config of its own: enabling context parallelism changes the model's config in place
    model = tf.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                attn_implementation=inner)
    model.load_state_dict(reference.state_dict())
    return reference, model


def _rows(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 5:9] = -100  # a few positions without a target: the token-weighted loss
    labels[1, SEQ // 2] = -100
    return {"input_ids": ids, "labels": labels}


def parity(family: str, mode: str, inner: str, block_size: int | None = None,
           compiled: bool = False, **overrides) -> dict:
    ctx = merak.init(dp=1, tp=1, pp=1, cp=dist.get_world_size())
    group, cp, rank = ctx.cp_group, ctx.cp, ctx.cp_rank
    reference, model = _models(family, inner, **overrides)
    attention = enable_context_parallel(model, group, mode)
    if block_size is not None:  # Ulysses' query blocks (eager, windows): several per row
        attention.block_size = block_size
    run = torch.compile(model, backend="eager") if compiled else model
    compared = Compared()
    for step in range(2):
        rows = _rows(step)
        expected = reference(**rows)
        expected.loss.backward()
        mine = split_batch(rows, cp, rank)
        count = torch.tensor(int(rows["labels"][:, 1:].ne(-100).sum()))
        loss = run(**mine, num_items_in_batch=count).loss  # this rank's share of the sum
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        compared.value(f"step {step} loss", total, expected.loss.detach())
        ours = dict(model.named_parameters())
        for name, param in reference.named_parameters():
            grad = ours[name].grad.clone()
            dist.all_reduce(grad, group=group)  # cp ranks hold the same weights
            compared.value(f"step {step} grad of {name}", grad, param.grad)
        for m in (model, reference):
            m.zero_grad()
    return compared.figures(attention_calls=attention.calls, layers=ATTN["num_hidden_layers"])


def _refusal(model, mine: dict, kind: type[Exception]) -> dict:
    """``{"refusal": the message of the `kind` error the forward raised, or None}``."""
    try:
        model(**mine)
    except kind as error:
        return {"refusal": str(error)}
    return {"refusal": None}


def window_refused_by_ring() -> dict:
    """Ring attention on a sliding window the split cuts (a NotImplementedError)."""
    _, model = _models("mistral", "eager", sliding_window=8)
    enable_context_parallel(model, merak.init(pp=1, cp=dist.get_world_size()).cp_group, "ring")
    mine = split_batch(_rows(0), dist.get_world_size(), dist.get_rank())
    return _refusal(model, mine, NotImplementedError)


def ulysses_query_heads_refused() -> dict:
    """Ulysses with query heads cp does not divide (a ValueError)."""
    _, model = _models("llama", "sdpa", hidden_size=48, num_attention_heads=6,
                       num_key_value_heads=2)
    enable_context_parallel(model, merak.init(pp=1, cp=dist.get_world_size()).cp_group,
                            "ulysses")
    mine = split_batch(_rows(0), dist.get_world_size(), dist.get_rank())
    return _refusal(model, mine, ValueError)


def layout() -> dict:
    """The (pp, dp, cp, tp) rank layouts dp2 x cp2, tp2 x cp2 and dp2 x tp2 (cp = 1): this
    rank's coordinates and its groups' ranks in each, for the test to check."""
    ranks = dist.get_process_group_ranks
    ctx = merak.init(dp=2, tp=1, pp=1, cp=2)
    seen = {"rank": ctx.rank}
    seen["dp2cp2"] = {"dp_rank": ctx.dp_rank, "cp_rank": ctx.cp_rank, "describe": ctx.describe(),
                      "cp_group": ranks(ctx.cp_group), "dp_group": ranks(ctx.dp_group),
                      "replica_group": ranks(ctx.replica_group), "replicas": ctx.replicas,
                      "rank_of_dp1_cp0": ctx.rank_of(dp_rank=1, cp_rank=0)}
    ctx = merak.init(dp=1, tp=2, pp=1, cp=2)
    seen["tp2cp2"] = {"cp_rank": ctx.cp_rank, "tp_rank": ctx.tp_rank, "describe": ctx.describe(),
                      "cp_group": ranks(ctx.cp_group), "replica_group": ranks(ctx.replica_group)}
    ctx = merak.init(dp=2, tp=2, pp=1)
    seen["dp2tp2"] = {"cp": ctx.cp, "cp_group_is_none": ctx.cp_group is None,
                      "mesh_dims": list(ctx.mesh.mesh_dim_names),
                      "replica_group": ranks(ctx.replica_group), "dp_group": ranks(ctx.dp_group)}
    return seen


def scenarios(world_size: int) -> dict:
    def run(*args, **kw):
        return lambda: parity(*args, **kw)

    cp = world_size
    out = {f"{family}-cp{cp}-{mode}-{inner}": run(family, mode, inner)
           for family, inner in (("llama", "sdpa"), ("qwen2", "eager"))
           for mode in ("ulysses", "ring")}
    # grouped-query attention with 1 and 2 key/value heads (8 query heads; the scenarios above
    # have 4): Ulysses repeats the key/value heads cp does not divide; the ring's kernels take
    # them as they are
    for kv in (1, 2):
        for mode in ("ulysses", "ring"):
            out[f"llama-cp{cp}-{mode}-sdpa-kv{kv}"] = run("llama", mode, "sdpa",
                                                          num_key_value_heads=kv)
    # sliding windows (Ulysses), with 2 key/value heads (repeated at cp=4): eager and sdpa
    # take the window in block masks
    for inner in ("eager", "sdpa"):
        out[f"mistral-cp{cp}-ulysses-window-{inner}"] = run(
            "mistral", "ulysses", inner, sliding_window=8, num_key_value_heads=2)
    if world_size == 2:  # several query blocks per row (4 and 8 rows of 24)
        # torch.compile: Dynamo leaves the wrapper out of its graph (it runs across the split)
        out["llama-cp2-ring-sdpa-compiled"] = run("llama", "ring", "sdpa", compiled=True)
        for inner in ("eager", "sdpa"):
            out[f"mistral-cp2-ulysses-window-{inner}-blocks"] = run(
                "mistral", "ulysses", inner, block_size=4, sliding_window=8)
        out["qwen2-cp2-ulysses-eager-blocks"] = run("qwen2", "ulysses", "eager", block_size=8)
        out[RING_WINDOW] = window_refused_by_ring
    if world_size == 4:
        out[ULYSSES_HEADS] = ulysses_query_heads_refused
        out[LAYOUT] = layout
    return out


def scenario_names(world_size: int) -> list[str]:
    return list(scenarios(world_size))


# the scenarios that return a refusal or a layout, not a comparison
RING_WINDOW = "mistral-cp2-ring-window-refused"
ULYSSES_HEADS = "llama-cp4-ulysses-query-heads-refused"
LAYOUT = "layout-dp2cp2-tp2cp2"
NOT_COMPARED = (RING_WINDOW, ULYSSES_HEADS, LAYOUT)


if __name__ == "__main__":
    from common import run_scenarios

    run_scenarios(scenarios(int(__import__("os").environ["WORLD_SIZE"])))
