"""Small Merak checkpoints written in one process, for the checkpoint safety tests.

A two-stage (pp=2) layout of a tiny Llama, each "rank" a fake context and a stage that is just
its share of the model's parameters, written with the same steps `save_checkpoint` takes on
each rank (`begin_save` on rank 0, `stage_rank_files` and `write_rank_files` on every rank,
`write_model_state` of every rank's weights, `finish_save` and `rotate` on rank 0) minus the
barriers (the weights, a collective of the ranks in a job, are written here in one call),
synchronously or with the writing and publishing on a background writer thread. The weights of
each save are `values(step, version)`, so a reader can tell which save a checkpoint it resolved
holds.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from merak.checkpoint import io as checkpoint
from merak.checkpoint.files import Layout

PP = 2


def config() -> LlamaConfig:
    return LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2,
                       tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


_NAMES: dict[str, tuple[int, ...]] | None = None


def shapes() -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the tiny Llama (built once, on meta)."""
    global _NAMES
    if _NAMES is None:
        with torch.device("meta"):
            model = LlamaForCausalLM(config())
        _NAMES = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return _NAMES


def stage_names(stage_id: int) -> list[str]:
    """Stage 0: the embeddings and layer 0; stage 1: layer 1, the norm and the head."""
    first = [n for n in shapes() if n.startswith(("model.embed_tokens", "model.layers.0."))]
    return first if stage_id == 0 else [n for n in shapes() if n not in first]


def values(step: int, version: int) -> dict[str, torch.Tensor]:
    """The whole model's weights of save (step, version): distinct per save and per tensor."""
    return {name: torch.full(shape, 1000.0 * version + step + i / 100)
            for i, (name, shape) in enumerate(shapes().items())}


class Stage(torch.nn.Module):
    """A pipeline stage as `write_rank_files` reads it: a module holding `tensors` as
    parameters under their dotted names (no buffers)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        for name, tensor in tensors.items():
            owner = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, torch.nn.Parameter(tensor))


def ctx(rank: int, pp: int = PP) -> SimpleNamespace:
    """rank `rank` of a dp1 x tp1 x pp`pp` job."""
    return SimpleNamespace(rank=rank, dp_rank=0, tp_rank=0, pp_rank=rank, dp=1, tp=1, pp=pp,
                           world_size=pp, cp=1, cp_rank=0)


def state(step: int, version: int) -> dict:
    return {"scheduler": {}, "version": version,
            "trainer": {"global_step": step, "epoch": step / 10, "log_history": []}}


def save(root: Path, step: int, version: int, *, limit: int | None = None,
         background=None) -> Path:
    """Every rank's part of ``checkpoint-<step>``, in `save_checkpoint`'s order. `background`
    (a `BackgroundSaves`): staged here, written and published on its writer thread, after the
    save before it has finished (as `save_checkpoint` does with ``save_async``)."""
    final = Path(root) / f"checkpoint-{step}"
    whole = values(step, version)
    if background is not None:
        background.wait()
    checkpoint.begin_save(final)
    staged = [checkpoint.stage_rank_files(ctx(rank), Stage({n: whole[n] for n in
                                                            stage_names(rank)}),
                                          state(step, version), copy=background is not None)
              for rank in range(PP)]

    def write() -> None:
        partial = final.with_name(final.name + ".partial")
        for files in staged:
            checkpoint.write_rank_files(partial, files)
        checkpoint.write_model_state(partial / checkpoint.MODEL_DIR,
                                     {k: v for files in staged for k, v in files["model"].items()})
        checkpoint.finish_save(final, Layout(step, 1, 1, PP), config=config())
        checkpoint.rotate(root, limit)

    if background is None:
        write()
    else:
        background.submit(final.name, write)
    return final


def model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the weights of `path`, read straight from DCP's files."""
    return checkpoint.read_whole_tensors(Path(path) / checkpoint.MODEL_DIR)


def data_file(path: Path) -> Path:
    """A data file of the weights of `path` (what a lost or cut file is)."""
    return sorted((Path(path) / checkpoint.MODEL_DIR).glob("*.distcp"))[0]


def version_of(path: Path, step: int) -> int:
    """Which save of `step` `path` holds, checked whole: every tensor of that save's weights
    and every rank's state say the same version."""
    layout = checkpoint.read_layout(path)
    assert layout.step == step, (path, layout)
    states = [checkpoint.load_rank_state(Path(path) / f"rank{r}.pt") for r in range(PP)]
    versions = {s["version"] for s in states}
    assert len(versions) == 1, (path, versions)
    version = versions.pop()
    tensors = checkpoint.full_tensors(Path(path))
    expected = values(step, version)
    assert sorted(tensors) == sorted(expected), path
    for name, tensor in tensors.items():
        torch.testing.assert_close(tensor, expected[name], msg=f"{path}: {name}")
    return version
