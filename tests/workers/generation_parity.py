"""Pipelined generation (`merak.generate`) against HF `generate` on the single-process model:
meta build -> `merak.parallelize` -> generate for 8 prompts of different lengths. Greedy tokens
equal HF's, prompt by prompt, on every rank; the KV cache is used (after the prompt, every
hidden-state transfer carries one position per request); sampling with a seed repeats, and all
ranks agree. Runs in tp_parity.py's 4- and 8-rank launches (see test_generation)."""

from __future__ import annotations

import torch
from hf_models import FAMILIES, batch

import merak
from merak.generation.generate import new_tokens
from merak.runtime.p2p import StageTransfers

SEED, NEW_TOKENS = 11, 6
LENGTHS = (3, 9, 5, 12, 1, 7, 4, 10)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, 128, (n,), generator=g).tolist() for n in LENGTHS]


def hf_greedy(family: str) -> list[list[int]]:
    """HF `generate` on the single-process model, one prompt at a time (no padding)."""
    torch.manual_seed(SEED)
    model = FAMILIES[family]().eval()
    pad = model.generation_config.pad_token_id or 0
    out = []
    for p in prompts():
        ids = torch.tensor([p])
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=NEW_TOKENS, pad_token_id=pad)[0, len(p):]
        # up to and including eos, as merak.generate returns
        out.append(new_tokens(tokens, {model.generation_config.eos_token_id}))
    return out


class _Positions:
    """Records the positions per request of every hidden-state message this rank sends."""

    def __enter__(self):
        self.sent, self._original = [], StageTransfers.exchange

        def exchange(transfers, action, tensor, *, is_send):
            if is_send:
                self.sent.append(tensor.shape[1])
            return self._original(transfers, action, tensor, is_send=is_send)

        StageTransfers.exchange = exchange
        return self

    def __exit__(self, *exc):
        StageTransfers.exchange = self._original


def parity(family: str, dp: int, tp: int, pp: int, parallel_vocab: bool = False,
           sampling: bool = False) -> dict:
    """Greedy tokens next to HF generate's; the positions each hidden-state transfer carried
    (prefill: the padded prompt, then one per step with the KV cache) next to the prompt
    width; with `sampling`, whether the seed decides the samples on every rank alike."""
    ctx = merak.init(dp=dp, tp=tp, pp=pp)
    torch.manual_seed(SEED)
    with merak.init_empty_weights():
        model = FAMILIES[family]()
    stage = merak.parallelize(model, batch(family, 0, 2), ctx, parallel_vocab=parallel_vocab)
    with _Positions() as positions:
        got = merak.generate(model, stage, prompts(), max_new_tokens=NEW_TOKENS, ctx=ctx)
    figures = {"tokens": got, "hf_tokens": hf_greedy(family)}
    if ctx.pp_rank < ctx.pp - 1:  # this rank sends hidden states on
        mine = prompts()[ctx.dp_rank * 8 // dp:(ctx.dp_rank + 1) * 8 // dp]
        figures.update(positions_sent=positions.sent, prompt_width=max(map(len, mine)))
    if sampling:
        figures.update(_sampling(ctx, model, stage))
    return figures


def _sampling(ctx, model, stage) -> dict:
    sample = {"max_new_tokens": NEW_TOKENS, "do_sample": True, "temperature": 0.7,
              "top_k": 50, "top_p": 0.95, "ctx": ctx}
    first = merak.generate(model, stage, prompts(), seed=3, **sample)
    again = merak.generate(model, stage, prompts(), seed=3, **sample)
    other = merak.generate(model, stage, prompts(), seed=4, **sample)
    everyone = [None] * ctx.world_size
    torch.distributed.all_gather_object(everyone, first)
    return {"same_seed_same": again == first, "other_seed_differs": other != first,
            "ranks_sampled_alike": all(e == first for e in everyone)}


# Llama at tp2 x pp2 on 4 ranks and at dp x tp x pp on 8 (dp splits the prompts), with the
# vocab-parallel embedding and LM head (shadowed on the middle stages). Qwen2 and GPT-2 pass
# here too; the suite's time budget leaves GPT-2 (tied embeddings) to test_trainer's ZeRO-3
# run at dp2 x pp2, which generates greedily against HF generate as well.
SCENARIOS = {
    4: {"generate-llama-tp2-pp2": lambda: parity("llama", 1, 2, 2, sampling=True)},
    8: {"generate-llama-dp2-tp2-pp2": lambda: parity("llama", 2, 2, 2, parallel_vocab=True,
                                                     sampling=True)},
}
