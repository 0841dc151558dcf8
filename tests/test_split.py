"""The stage split as data: transfers, batch inputs, tied weights, errors."""

from __future__ import annotations

import pytest
import torch
from models import SKIP_LAYOUT, SkipNet, skip_pieces

import merak
from merak import Piece, PipelineStage, manual_split
from merak.models.gpt import GPT, GPTConfig, gpt_pieces


def test_skip_net_transfers():
    model = SkipNet()
    split = manual_split(model, skip_pieces(), pieces_per_stage=SKIP_LAYOUT[4])
    assert split.num_stages == 4
    assert sorted(split.edges) == [(0, 1), (0, 2), (1, 2), (2, 3)]
    assert [n for n, _ in split.transfers[(1, 2)]] == ["h", "g"]
    assert split.batch_inputs(0) == ["x"] and split.batch_inputs(3) == ["y"]
    assert split.batch_inputs(1) == [] and split.batch_inputs(2) == []
    assert "from 0  h0" in split.describe()


def test_gpt_tied_weight_and_names():
    model = GPT(GPTConfig(hidden_size=16, num_layers=4, num_heads=2))
    split = manual_split(model, gpt_pieces(model), num_stages=3)
    assert [len(split.piece_ids(s)) for s in range(3)] == [2, 2, 2]
    (tied,) = split.tied_weights
    assert tied.names == ((0, "embed.wte.weight"), (2, "head.lm_head.weight"))
    stage = PipelineStage(model, split, 2)
    assert {n for n, _ in stage.named_parameters()} >= {"blocks.3.qkv.weight",
                                                        "head.lm_head.weight"}
    assert not manual_split(model, gpt_pieces(model), num_stages=3,
                            tie_weights=False).tied_weights


def test_one_stage_runs_the_whole_model():
    model = GPT(GPTConfig(hidden_size=16, num_layers=2, num_heads=2))
    split = manual_split(model, gpt_pieces(model), num_stages=1)
    ids = torch.randint(0, 256, (2, 8))
    values = PipelineStage(model, split, 0)({("input_ids", -1): ids, ("labels", -1): ids})
    torch.testing.assert_close(values[split.output_key], model(ids, ids))


@pytest.mark.parametrize("kwargs,message", [
    ({"num_stages": 9}, "cannot split 6 pieces into 9"),
    ({"pieces_per_stage": [3, 2]}, "sum to the number of pieces"),
    ({}, "exactly one of"),
])
def test_bad_stage_counts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        manual_split(SkipNet(), skip_pieces(), **kwargs)


def test_unknown_module_is_named():
    with pytest.raises(ValueError, match="nonexistent"):
        manual_split(SkipNet(), [Piece("nonexistent", ["x"], ["loss"])], num_stages=1)


def test_last_piece_must_produce_the_loss():
    with pytest.raises(ValueError, match="must output 'loss'"):
        manual_split(SkipNet(), skip_pieces()[:-1], num_stages=1)


def test_wrong_output_arity_is_named():
    split = manual_split(SkipNet(), [Piece("b", ["x"], ["loss"])], num_stages=1)
    stage = PipelineStage(SkipNet(), split, 0)
    with pytest.raises(ValueError, match="returned 2 values"):
        stage({("x", -1): torch.randn(2, 16)})


def test_init_rejects_non_positive_degrees():
    with pytest.raises(ValueError, match="tp must be positive"):
        merak.init(dp=1, tp=0, pp=1)
    with pytest.raises(TypeError, match="pp must be a positive int"):
        merak.init(dp=1, tp=1, pp=1.5)


def test_import_Merak_alias():
    import Merak

    assert Merak.init is merak.init and Merak.PipelineInterpreter is merak.PipelineInterpreter
