"""Nothing lost: checkpoints are listed, replaced, validated and exported only whole.

- The listing ignores names that are not ``checkpoint-<int>`` (a ``checkpoint-best/`` holding
  ``merak.json`` crashed it) and anything incomplete.
- Replacing a step keeps the old copy valid until the new one is in place; every state a kill
  can leave behind resolves to a complete copy, and the next save tidies it.
- ``merak.json`` and the resumed trainer state are validated, errors naming file and field.
- ``merak export`` and loading refuse a checkpoint missing a stage's file or a parameter of its
  config's model, naming what is missing (the CLI exits 1 and writes nothing).
The kills at every point of a save: test_checkpoint_faults.py. Fixtures: checkpoint_fixtures.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
from checkpoint_fixtures import (
    PP,
    Stage,
    ctx,
    data_file,
    save,
    shapes,
    stage_names,
    values,
    version_of,
)

from merak.checkpoint import io as checkpoint
from merak.checkpoint.files import (
    CheckpointError,
    IncompleteCheckpointError,
    check_trainer_state,
    read_layout,
)
from merak.cli import main as merak_main


def names(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_listing_ignores_names_that_are_not_checkpoint_int(tmp_path):
    save(tmp_path, 2, 0)
    save(tmp_path, 10, 0)
    shutil.copytree(tmp_path / "checkpoint-2", tmp_path / "checkpoint-best")
    shutil.copytree(tmp_path / "checkpoint-2", tmp_path / "checkpoint-3.bak")
    (tmp_path / "checkpoint-7").write_text("a file, not a directory")
    found = checkpoint.complete_checkpoints(tmp_path)
    assert [p.name for p in found] == ["checkpoint-2", "checkpoint-10"]  # numeric order
    assert checkpoint.resolve(True, tmp_path).name == "checkpoint-10"
    checkpoint.rotate(tmp_path, 1)
    assert names(tmp_path) == ["checkpoint-10", "checkpoint-3.bak", "checkpoint-7",
                               "checkpoint-best"]


def test_rotation_keeps_the_newest_and_the_best(tmp_path):
    for step in (2, 4, 6, 8):
        save(tmp_path, step, 0)
    checkpoint.rotate(tmp_path, 1, keep=tmp_path / "checkpoint-4")
    assert names(tmp_path) == ["checkpoint-4", "checkpoint-8"]
    checkpoint.rotate(tmp_path, 1)
    assert names(tmp_path) == ["checkpoint-8"]


def test_a_checkpoint_missing_a_file_is_not_listed(tmp_path):
    save(tmp_path, 2, 0)
    save(tmp_path, 4, 0)
    os.unlink(tmp_path / "checkpoint-4" / "rank1.pt")  # merak.json still there
    with pytest.warns(UserWarning, match=r"checkpoint-4.*rank1\.pt"):
        assert checkpoint.resolve(True, tmp_path).name == "checkpoint-2"
    with pytest.raises(IncompleteCheckpointError, match=r"rank1\.pt"):
        checkpoint.resolve(str(tmp_path / "checkpoint-4"), tmp_path)


# --- replacing a checkpoint: every state a kill can leave --------------------------------


def _old_and_new(root):
    """checkpoint-4 of version 0 in place, version 1 complete in checkpoint-4.partial: a
    re-save of step 4 killed right after its marker was written."""
    save(root, 4, 0)
    os.rename(root / "checkpoint-4", root / "keep")
    save(root, 4, 1)
    os.rename(root / "checkpoint-4", root / "checkpoint-4.partial")
    os.rename(root / "keep", root / "checkpoint-4")


def _half_delete(path):
    """What an interrupted ``rmtree`` leaves: some files gone, merak.json still there."""
    os.unlink(data_file(path))
    os.unlink(path / "rank1.pt")


STATES = {  # name -> (how to get there from `_old_and_new`, the version to resume)
    "new-complete-in-partial": (lambda r: None, 1),
    "old-half-deleted-in-place": (lambda r: _half_delete(r / "checkpoint-4"), 1),
    "old-aside-new-in-partial": (
        lambda r: os.rename(r / "checkpoint-4", r / "checkpoint-4.replaced"), 1),
    "old-aside-only": (lambda r: (
        os.rename(r / "checkpoint-4", r / "checkpoint-4.replaced"),
        shutil.rmtree(r / "checkpoint-4.partial")), 0),
    "old-aside-new-in-place": (lambda r: (
        os.rename(r / "checkpoint-4", r / "checkpoint-4.replaced"),
        os.rename(r / "checkpoint-4.partial", r / "checkpoint-4")), 1),
    "old-aside-half-deleted": (lambda r: (
        os.rename(r / "checkpoint-4", r / "checkpoint-4.replaced.deleting"),
        _half_delete(r / "checkpoint-4.replaced.deleting"),
        os.rename(r / "checkpoint-4.partial", r / "checkpoint-4")), 1),
    "new-partial-half-written": (lambda r: os.unlink(r / "checkpoint-4.partial" / "rank0.pt"),
                                 0),
}


@pytest.mark.parametrize("case", sorted(STATES))
def test_each_state_of_an_interrupted_replace_resumes_and_is_tidied(tmp_path, case):
    _old_and_new(tmp_path)
    make, version = STATES[case]
    make(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = checkpoint.resolve(True, tmp_path)
        assert version_of(found, 4) == version
        assert version_of(checkpoint.resolve(str(tmp_path / "checkpoint-4"), tmp_path), 4) \
            == version
    checkpoint.repair(tmp_path)  # what the next save does first
    assert names(tmp_path) == ["checkpoint-4"]
    assert version_of(tmp_path / "checkpoint-4", 4) == version
    save(tmp_path, 4, 2)  # and replacing it again lands cleanly
    assert names(tmp_path) == ["checkpoint-4"]
    assert version_of(tmp_path / "checkpoint-4", 4) == 2


def test_save_checkpoint_in_one_process_replaces_atomically(tmp_path):
    """The collective entry point, world size 1 (no process group: no barriers)."""
    tensors = {n: t for n, t in values(6, 3).items()}
    one = ctx(0, pp=1)
    for version in (0, 1):
        state = {"scheduler": {}, "version": version,
                 "trainer": {"global_step": 6, "epoch": 1.0, "log_history": []}}
        path = checkpoint.save_checkpoint(tmp_path, 6, one, Stage(tensors), state,
                                          save_total_limit=1)
    assert names(tmp_path) == ["checkpoint-6"] and path == tmp_path / "checkpoint-6"
    assert read_layout(path).pp == 1
    assert checkpoint.load_rank_state(path / "rank0.pt")["version"] == 1


# --- metadata ------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "field"), [
    ("{not json", "JSON"), ("[1, 2]", "JSON object"), ('{"step": 4, "tp": 1, "pp": 2}', "'dp'"),
    ('{"step": 4, "dp": 1, "tp": 0, "pp": 2}', "'tp'"),
    ('{"step": -3, "dp": 1, "tp": 1, "pp": 2}', "'step'"),
    ('{"step": "4", "dp": 1, "tp": 1, "pp": 2}', "'step'"),
    ('{"step": 4, "dp": 1, "tp": 1, "pp": true}', "'pp'"),
    ('{"step": 4, "dp": 1, "tp": 1, "pp": 2, "name_prefix": 3}', "'name_prefix'")])
def test_corrupt_metadata_is_named_with_its_file_and_field(tmp_path, text, field):
    save(tmp_path, 2, 0)
    save(tmp_path, 4, 0)
    marker = tmp_path / "checkpoint-4" / "merak.json"
    marker.write_text(text)
    with pytest.raises(CheckpointError, match=field) as error:
        read_layout(tmp_path / "checkpoint-4")
    assert str(marker) in str(error.value)
    with pytest.raises(CheckpointError, match=field):
        checkpoint.resolve(str(tmp_path / "checkpoint-4"), tmp_path)
    with pytest.warns(UserWarning, match=field):  # the listing skips it, saying why
        assert checkpoint.resolve(True, tmp_path).name == "checkpoint-2"


def test_a_marker_of_another_step_is_not_resumed(tmp_path):
    save(tmp_path, 4, 0)
    os.rename(tmp_path / "checkpoint-4", tmp_path / "checkpoint-9")
    with pytest.warns(UserWarning, match="step is 4, not 9"):
        assert checkpoint.complete_checkpoints(tmp_path) == []


@pytest.mark.parametrize(("change", "field"), [
    ({"global_step": -3}, "global_step"), ({"global_step": 10 ** 9}, "global_step"),
    ({"global_step": "4"}, "global_step"), ({"epoch": -1.0}, "epoch"),
    ({"epoch": "1"}, "epoch"), ({"log_history": None}, "log_history")])
def test_a_resumed_trainer_state_is_validated(change, field):
    state = {"scheduler": {}, "trainer": {"global_step": 4, "epoch": 0.4, "log_history": [],
                                          **change}}
    with pytest.raises(CheckpointError, match=rf"rank0\.pt: field 'trainer\.{field}'"):
        check_trainer_state(state, "out/checkpoint-4/rank0.pt", 4)
    assert check_trainer_state({"scheduler": {}, "trainer": {
        "global_step": 4, "epoch": 0.4, "log_history": []}}, "f", 4)["global_step"] == 4
    with pytest.raises(CheckpointError, match=r"f: field 'trainer' is missing"):
        check_trainer_state({"scheduler": {}}, "f", 4)


# --- export and loading ------------------------------------------------------------------


def test_export_of_a_whole_checkpoint_loads_every_tensor(tmp_path):
    from safetensors.torch import load_file

    path = save(tmp_path / "run", 4, 0)
    assert merak_main(["export", str(path), str(tmp_path / "hf")]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    expected = values(4, 0)
    assert sorted(exported) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(exported[name], expected[name])


def test_export_refuses_a_checkpoint_missing_a_data_file(tmp_path, capsys):
    path = save(tmp_path / "run", 4, 0)
    lost = data_file(path)
    os.unlink(lost)
    assert merak_main(["export", str(path), str(tmp_path / "hf")]) == 1
    assert f"model/{lost.name}" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()  # nothing half written


def test_export_refuses_a_cut_data_file(tmp_path, capsys):
    path = save(tmp_path / "run", 4, 0)
    cut = data_file(path)
    os.truncate(cut, cut.stat().st_size // 2)
    assert merak_main(["export", str(path), str(tmp_path / "hf")]) == 1
    assert f"model/{cut.name} (cut short)" in capsys.readouterr().err


def test_export_refuses_weights_that_leave_out_parameters(tmp_path, capsys):
    """Weights saved without stage 1's tensors: the config's model names the parameters that
    are then missing."""
    import shutil

    path = save(tmp_path / "run", 4, 0)
    shutil.rmtree(path / checkpoint.MODEL_DIR)
    first = values(4, 0)
    checkpoint.write_model_state(path / checkpoint.MODEL_DIR,
                                 {n: first[n] for n in stage_names(0)})
    assert merak_main(["export", str(path), str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert "lm_head.weight" in err and "model.layers.1" in err and "config.json" in err
    assert not (tmp_path / "hf").exists()


def test_loading_names_the_missing_file(tmp_path):
    path = save(tmp_path, 4, 0)
    lost = data_file(path)
    os.unlink(lost)
    whole = {n: torch.zeros(s) for n, s in shapes().items()}
    own = Stage({n: whole[n] for n in stage_names(0)})
    with pytest.raises(IncompleteCheckpointError, match=rf"model/{lost.name}"):
        checkpoint.load_checkpoint(path, ctx(0), own)  # the same layout, stage 0
    with pytest.raises(IncompleteCheckpointError, match=rf"model/{lost.name}"):
        checkpoint.load_checkpoint(path, ctx(0, pp=1), Stage(whole))  # resharded to pp=1
    save(tmp_path, 6, 0)
    os.unlink(tmp_path / "checkpoint-6" / "rank1.pt")
    with pytest.raises(IncompleteCheckpointError, match=r"rank1\.pt"):
        checkpoint.load_checkpoint(tmp_path / "checkpoint-6", ctx(1),
                                   Stage({n: whole[n] for n in stage_names(1)}))
    state, same = checkpoint.load_checkpoint(tmp_path / "checkpoint-6", ctx(0), own)
    assert same and state["version"] == 0
    merged = Stage(whole)  # the two stages' weights into one (pp=1): read from both saves
    _, same = checkpoint.load_checkpoint(tmp_path / "checkpoint-6", ctx(0, pp=1), merged)
    assert not same and PP == 2
    for loaded in (own, merged):
        for name, param in loaded.named_parameters():
            assert torch.equal(param, values(6, 0)[name]), name


def test_the_config_check_counts_tied_lora_and_prefixed_names(tmp_path):
    """A tied group needs one of its names; LoRA's base_layer weights count as the base
    model's and its adapters are not asked for; a loss wrapper's name prefix is removed."""
    from checkpoint_fixtures import config

    from merak.checkpoint.files import missing_model_tensors

    tied = config()
    tied.tie_word_embeddings = True
    tied.save_pretrained(tmp_path)
    (tmp_path / "merak.json").write_text(json.dumps({"step": 1, "dp": 1, "tp": 1, "pp": 1}))
    held = [n for n in shapes() if n != "lm_head.weight"]
    assert missing_model_tensors(tmp_path, held) == []
    lora = [n.replace("q_proj.weight", "q_proj.base_layer.weight") for n in held]
    adapter = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert missing_model_tensors(tmp_path, [*lora, adapter]) == []
    assert missing_model_tensors(tmp_path, held[1:]) == ["model.embed_tokens.weight"]
    (tmp_path / "merak.json").write_text(json.dumps({"step": 1, "dp": 1, "tp": 1, "pp": 1,
                                                     "name_prefix": "model."}))
    assert missing_model_tensors(tmp_path, ["model." + n for n in held]) == []
    assert missing_model_tensors(tmp_path, held) != []  # (unprefixed names are not its)
