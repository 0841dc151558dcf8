"""`merak coverage` on a fixed handful of families (the full sweep is the command's job, not the
suite's), and the generic config shrinking it relies on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from merak.coverage import NO_PLAN
from merak.coverage.cli import failures, summarize
from merak.coverage.shrink import LAYERS, TooLargeError, _representative, build_small, small_config

# an MoE family (router logits leave its blocks for the auxiliary loss) and OLMo2 (its
# base_model_tp_plan gathers q/k/v for a full-width q_norm); tests/test_tensor_parallel.py runs
# more families' config plans, tests/test_auto_split.py more families' splits
FAMILIES = ("mixtral", "olmo2")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("coverage") / "coverage.json"
    run = subprocess.run([sys.executable, "-m", "merak", "coverage", "--stages", "2", "--tp",
                          "2", "--families", ",".join(FAMILIES), "--json", str(out)],
                         capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text()), run.stdout


def test_the_handful_splits_and_shards_at_parity(sweep):
    result, stdout = sweep
    rows = {r["family"]: r for r in result["families"]}
    assert sorted(rows) == sorted(FAMILIES)
    for family, row in rows.items():
        for check in ("build", "single", "pp", "tp", "load"):
            assert row.get(check) == "ok", f"{family} {check}: {row.get(check)}"
    assert rows["mixtral"]["moe"] and not rows["olmo2"]["moe"]
    # the ep column: Mixtral's experts split over both ranks (dp = ep = 2), OLMo2 has none
    assert rows["mixtral"].get("ep") == "ok" and "ep" not in rows["olmo2"], rows
    assert "pp=2 parity: 2/2 (100%)" in stdout
    assert "MoE families at pp=2 parity: 1/1 (100%)" in stdout
    assert "MoE families at ep=2 (dp=2) parity: 1/1 (100%)" in stdout
    # saved by save_pretrained (Mixtral: per-expert tensors), loaded per rank at pp=2 and tp=2
    assert ("save_pretrained -> per-rank load (pp=2, tp=2 where planned) parity: 2/2 (100%); "
            "MoE families: 1/1 (100%) (of the families HF's from_pretrained loads back)") in stdout


def test_the_summary_counts_failures_with_their_reasons():
    """Every family that runs counts in the tp column, by where its plan comes from; inferred
    plans that leave linears replicated are named, and each tp failure is listed with its
    reason."""
    rows = [{"family": "a", "build": "ok", "single": "ok", "pp": "ok", "tp": "ok",
             "tp_plan_source": "base_model_tp_plan", "moe": True},
            {"family": "b", "build": "ok", "single": "ok", "pp": "RuntimeError: x", "tp": "ok",
             "tp_plan_source": "inferred", "tp_replicated": 2, "moe": False},
            {"family": "d", "build": "ok", "single": "ok", "pp": "ok", "moe": False,
             "tp": f"{NO_PLAN}: ValueError: plan inference placed no layer of d"},
            {"family": "c", "build": "too large: 9 M parameters"}]
    lines = summarize(rows, 2, 2)
    assert lines[0] == "families: 4; build: 3; single-process forward/backward: 3"
    assert lines[1].startswith("pp=2 parity: 2/3 (67%)")
    assert lines[2] == ("tp=2 parity: 2/3 (67%) of the families that run (plans: Merak's table "
                        "0/0 (0%); the config's base_model_tp_plan 1/1 (100%); inferred from the "
                        "blocks 1/1 (100%); no plan: 1)")
    assert lines[3] == "inferred plans at parity that leave some linears replicated: 1 (b)"
    assert lines[4] == "MoE families at pp=2 parity: 1/1 (100%)"
    assert failures(rows, "tp") == ["  d: no plan: ValueError: plan inference placed no layer "
                                    "of d"]
    rows[0]["ep"] = "ValueError: no experts module: the family's experts do not go through"
    assert summarize(rows, 2, 2)[5] == "MoE families at ep=2 (dp=2) parity: 0/1 (0%)"
    assert failures(rows, "ep") == ["  a: ValueError: no experts module: the family's experts "
                                    "do not go through"]
    del rows[0]["ep"]
    rows[0]["load"], rows[1]["load"] = "ok", "ParityError: loss 1 != single-process 2"
    assert summarize(rows, 2, 2)[5] == (
        "save_pretrained -> per-rank load (pp=2, tp=2 where planned) parity: 1/2 (50%); MoE "
        "families: 1/1 (100%) (of the families HF's from_pretrained loads back)")


def test_shrinking_is_generic_and_refuses_what_stays_large():
    config = small_config("mixtral")
    assert (config.num_hidden_layers, config.hidden_size, config.num_local_experts,
            config.num_experts_per_tok) == (LAYERS, 64, 4, 2)
    assert config.output_router_logits  # the auxiliary loss is part of what is compared
    assert build_small("llama").parameters < 1_000_000
    with pytest.raises(TooLargeError, match="M parameters after shrinking"):
        build_small("llama", limit=1000)


def test_per_layer_lists_keep_every_kind_of_layer():
    kinds = ["linear"] * 6 + ["full"] + ["linear"] * 5 + ["full"]
    assert _representative(kinds) == ["linear", "linear", "linear", "full"]
    assert _representative(list(range(10))) == [0, 1, 2, 3]


@pytest.mark.parametrize("family", ["deepseek_v2", "axk2", "granite_swa", "got_ocr2"])
def test_families_the_sweep_found_failing_now_split_at_parity(family):
    """DeepSeek-V2: a rotary table passed on by a no-op ``.to()`` in each block; AXK2: a
    ``min(seq, window)`` size computed in block 0 and read by the later blocks; Granite-SWA: a
    parameter-free ModuleList (rotary embeddings) is not a list of blocks; GOT-OCR2 given text
    alone: its vision tower's layers never run, so they are not blocks. Split in one process
    from a meta build, loss and gradients equal the single-process model's."""
    from merak.coverage.checks import compare, reference, split_in_process

    small = build_small(family)
    compare(*split_in_process(small, 2), *reference(small, 1))
