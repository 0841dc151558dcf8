"""Context parallelism against the single-process model (see test_context_parallel): a tiny
Llama and Qwen2, each rank holding its load-balanced share of every row (`split_batch`), the
model's attention wrapped through transformers' registry (Ulysses or ring, around eager or
sdpa); the parity scenarios return the summed loss and every gradient (summed over the cp
ranks, which hold the same weights) next to the single-process model's (`Compared`), which
test_context_parallel compares; the refusals and the layout check themselves. cp is the world
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


def window_refused_by_ring() -> None:
    _, model = _models("mistral", "eager", sliding_window=8)
    enable_context_parallel(model, merak.init(pp=1, cp=dist.get_world_size()).cp_group, "ring")
    mine = split_batch(_rows(0), dist.get_world_size(), dist.get_rank())
    try:
        model(**mine)
    except NotImplementedError as error:
        assert "mistral" in str(error) and "sliding-window" in str(error), error
    else:
        raise AssertionError("ring attention ran a sliding window the split cuts")


def ulysses_query_heads_refused() -> None:
    _, model = _models("llama", "sdpa", hidden_size=48, num_attention_heads=6,
                       num_key_value_heads=2)
    enable_context_parallel(model, merak.init(pp=1, cp=dist.get_world_size()).cp_group,
                            "ulysses")
    try:
        model(**split_batch(_rows(0), dist.get_world_size(), dist.get_rank()))
    except ValueError as error:
        assert "llama" in str(error) and "6 query heads" in str(error), error
    else:
        raise AssertionError("Ulysses ran with query heads cp does not divide")


def layout() -> None:
    """The (pp, dp, cp, tp) rank layout: tp innermost, then cp, dp, pp; cp ranks share their
    dp rank (the same rows) and gradients are reduced over dp x cp."""
    ranks = dist.get_process_group_ranks
    ctx = merak.init(dp=2, tp=1, pp=1, cp=2)
    rank = ctx.rank
    assert (ctx.dp_rank, ctx.cp_rank) == divmod(rank, 2), ctx.describe()
    assert ranks(ctx.cp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    assert ranks(ctx.dp_group) == [rank % 2, rank % 2 + 2]
    assert ranks(ctx.replica_group) == [0, 1, 2, 3] and ctx.replicas == 4
    assert ctx.rank_of(dp_rank=1, cp_rank=0) == 2
    ctx = merak.init(dp=1, tp=2, pp=1, cp=2)
    assert (ctx.cp_rank, ctx.tp_rank) == divmod(rank, 2)
    assert ranks(ctx.cp_group) == [rank % 2, rank % 2 + 2]
    assert ranks(ctx.replica_group) == ranks(ctx.cp_group) and "cp=" in ctx.describe()
    ctx = merak.init(dp=2, tp=2, pp=1)  # cp = 1: the (pp, dp, tp) layout as before
    assert ctx.cp == 1 and ctx.cp_group is None and ctx.mesh.mesh_dim_names == ("pp", "dp", "tp")
    assert ranks(ctx.replica_group) == ranks(ctx.dp_group)


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
        out["mistral-cp2-ring-window-refused"] = window_refused_by_ring
    if world_size == 4:
        out["llama-cp4-ulysses-query-heads-refused"] = ulysses_query_heads_refused
        out["layout-dp2cp2-tp2cp2"] = layout
    return out


def scenario_names(world_size: int) -> list[str]:
    return list(scenarios(world_size))


# the scenarios that check themselves (raise on a failure) and return no figures
SELF_CHECKED = ("mistral-cp2-ring-window-refused", "llama-cp4-ulysses-query-heads-refused",
                "layout-dp2cp2-tp2cp2")


if __name__ == "__main__":
    from common import run_scenarios

    run_scenarios(scenarios(int(__import__("os").environ["WORLD_SIZE"])))
