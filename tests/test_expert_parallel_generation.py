"""Generation with expert parallelism (pooled worker ep_generation.py): the ranks of an ep group
decode their own prompts in lockstep (a rank done first, or with no prompt, keeps running
forwards until every rank is done), so every MoE layer's all-to-all meets. At dp2 ep2 (ZeRO-3
too) and dp2 ep2 pp2 (dp4 ep2 too with MERAK_TEST_MATRIX=full), every rank's result equals
single-process HF `generate` on each dp rank's share of the prompts: greedy with an eos ending
one rank's prompt early, one prompt for several dp ranks, and seeded sampling."""

from __future__ import annotations

import pytest
import torch
from dist_harness import scenario_result
from ep_generation import NEW_TOKENS, early_eos, moe_model, requests, scenarios

from merak.generation.generate import _share, left_padded, new_tokens

WORKER = "ep_generation.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (2, 4)


@pytest.fixture(scope="module")
def model():
    return moe_model().eval()


def hf_generate(model, dp: int, prompts: list[list[int]], seed: int = 0,
                eos_token_id: int | None = None, do_sample: bool = False,
                **sampling) -> list[list[int]]:
    """HF `generate` in one process on each dp rank's share of `prompts` (left-padded as
    `merak.generate` pads it), seeded alike for each share."""
    out = []
    for rank in range(dp):
        share = prompts[_share(len(prompts), dp, rank)]
        if not share:
            continue
        ids, mask = left_padded(share, 0, torch.device("cpu"))
        options = {"top_k": 0, "top_p": 1.0, **sampling} if do_sample else {}
        torch.manual_seed(seed)
        rows = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              do_sample=do_sample, pad_token_id=0, eos_token_id=eos_token_id,
                              **options)
        out += [new_tokens(r, {eos_token_id} - {None}) for r in rows[:, ids.shape[1]:]]
    return out


@pytest.mark.parametrize("world_size,scenario", [(w, s) for w in WORLD_SIZES
                                                 for s in scenarios(w)])
def test_generation_with_expert_parallelism_matches_hf_generate(launches, model, world_size,
                                                                scenario):
    figures = scenario_result(*launches(world_size), scenario)
    eos = early_eos(model)
    assert {f["eos"] for f in figures} == {eos}
    dp = figures[0]["dp"]
    for name, request in requests(eos).items():
        theirs = hf_generate(model, dp, **request)
        assert len(theirs) == len(request["prompts"])
        for f in figures:
            assert f["generated"][name] == theirs, (name, f["rank"])
    early = hf_generate(model, dp, **requests(eos)["greedy-early-eos"])
    # the lockstep was needed: prompt 0 ends at eos first, the others run to NEW_TOKENS
    assert early[0][-1] == eos and len(early[0]) < NEW_TOKENS, early
    assert all(len(row) == NEW_TOKENS for row in early[1:]), early
    held = {f["experts_held"] for f in figures}  # half of 4 experts x 2 layers (pp2: 1 layer)
    assert held == {(2048 + 1024) * (1 if "pp2" in scenario else 2)}, held
