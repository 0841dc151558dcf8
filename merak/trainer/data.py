"""Stage-aware, dp-sharded batches for the pipeline: one global batch per optimizer step.

Every rank walks the same global order of the dataset (sequential, or a permutation seeded by
``data_seed or seed`` and the epoch, identical on every rank). Step k's global batch is items
``[k*G, (k+1)*G)`` with G = micro-batch size x micro-batches x dp; dp rank r takes its r-th
slice; tp ranks of one dp rank take the same slice. Only stages that read model inputs or labels
(the split's ``batch_inputs``) touch the dataset at all; the others get None.

In training, the data collator runs on each micro-batch's rows, as HF Trainer collates each
gradient-accumulation batch (HF's per-device batch is one micro-batch here): a step is the list
of its micro-batches, so what a collator builds per batch keeps its structure (a padding-free
batch's one flattened row with its `position_ids` and ``cu_seq_lens_*``, padding to each
micro-batch's longest row, pairs of rows a loss reads together).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader

from merak.trainer.arguments import NotSupportedYetError


def model_input_filter(forward: Callable, label_names: Sequence[str] = ()) -> Callable[[dict],
                                                                                       dict]:
    """Drop batch keys the model's forward does not take (HF's remove_unused_columns)."""
    params = inspect.signature(forward).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return lambda batch: batch
    keep = set(params) | set(label_names)
    return lambda batch: {k: v for k, v in batch.items() if k in keep}


def loader_options(args) -> dict:
    """HF's dataloader_* fields as `torch.utils.data.DataLoader` keywords (HF's meaning: worker
    processes read and collate the batches; prefetch and persistence only with workers)."""
    options = {"num_workers": args.dataloader_num_workers,
               "pin_memory": args.dataloader_pin_memory and torch.cuda.is_available()
               and not args.use_cpu}
    if args.dataloader_num_workers > 0:
        options.update(persistent_workers=args.dataloader_persistent_workers,
                       prefetch_factor=args.dataloader_prefetch_factor,
                       multiprocessing_context=args.dataloader_multiprocessing_context)
    return options


def dataset_size(dataset, role: str) -> int:
    """len(`dataset`) (`role`: "train_dataset", "eval_dataset", ...), or `NotSupportedYetError`
    with the reason for a dataset without one: MerakTrainer reads items by index (each dp rank
    its share of every global batch), and a stream's size cannot be checked up front."""
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise NotSupportedYetError(
            f"MerakTrainer's {role} is an iterable dataset ({type(dataset).__name__}, no len()): "
            f"its size cannot be checked against a global batch, and MerakTrainer reads items "
            f"by index (each dp rank takes its share of every global batch); give a map-style "
            f"dataset (a list, torch Dataset, or datasets.Dataset: load_dataset without "
            f"streaming=True)")
    return len(dataset)


def check_train_dataset(dataset, micro_batch_size: int, num_microbatches: int, dp: int) -> None:
    """`dataset` holds at least one global batch (`micro_batch_size` x `num_microbatches` x
    `dp` items); checked before anything is built from its first items."""
    size = dataset_size(dataset, "train_dataset")
    rows = micro_batch_size * num_microbatches * dp
    if size == 0:
        raise ValueError("MerakTrainer's train_dataset is empty; give it at least one global "
                         "batch of items (per_device_train_batch_size x "
                         "gradient_accumulation_steps x dp)")
    if size < rows:
        raise ValueError(f"MerakTrainer's train_dataset has {size} items, fewer than one global "
                         f"batch: per_device_train_batch_size {micro_batch_size} x "
                         f"gradient_accumulation_steps {num_microbatches} x dp {dp} = {rows}; "
                         f"give at least {rows} items or lower those numbers")


def check_eval_dataset(dataset, role: str = "eval_dataset") -> None:
    """An evaluation set (or each of a dict of them) has items: a last partial global batch is
    padded, an empty set has nothing to evaluate."""
    for name, part in (dataset.items() if isinstance(dataset, dict) else [(None, dataset)]):
        where = role if name is None else f"{role}[{name!r}]"
        if part is not None and dataset_size(part, where) == 0:
            raise ValueError(f"MerakTrainer's {where} is empty; give at least one item, or "
                             f"no evaluation set")


def check_whole_steps(size: int, micro_batch_size: int, num_microbatches: int, dp: int,
                      role: str) -> None:
    """An evaluation set collated per micro-batch (`EvalBatches`' `per_microbatch`) fills
    whole steps: every micro-batch on every dp rank holds `micro_batch_size` items (the split
    runs the row count it was traced for, and there are no padding rows that a loss over pairs
    of rows would count)."""
    step = micro_batch_size * num_microbatches * dp
    if size % step:
        raise NotSupportedYetError(
            f"{role} collates each micro-batch on its own items, and its {size} items do not "
            f"fill whole evaluation steps of {step} (micro-batches of {micro_batch_size}, "
            f"{num_microbatches} per dp rank, at dp={dp}); give a multiple of {step} items")


class StageBatches:
    """The training batches of this rank, one per optimizer step: the list of its
    `num_microbatches` micro-batches, each collated from its own rows, read through a
    `DataLoader` over the micro-batches' index lists (`loader` holds its keywords: workers,
    pinning, prefetch)."""

    def __init__(self, dataset, collate: Callable[[list], dict], *, micro_batch_size: int,
                 num_microbatches: int, dp: int, dp_rank: int, strategy: str, seed: int,
                 reads_data: bool, loader: dict | None = None):
        if strategy not in ("random", "sequential"):
            raise ValueError(f"train_sampling_strategy={strategy!r} is not supported yet by "
                             f"MerakTrainer; use 'random' or 'sequential'")
        self.dataset, self.collate = dataset, collate
        self.micro_batch_size, self.num_microbatches = micro_batch_size, num_microbatches
        self.local = micro_batch_size * num_microbatches
        self.global_size = self.local * dp
        self.dp_rank, self.strategy, self.seed = dp_rank, strategy, seed
        self.reads_data, self.loader = reads_data, dict(loader or {})
        if len(dataset) < self.global_size:
            raise ValueError(f"the dataset has {len(dataset)} items, fewer than one global batch "
                             f"({micro_batch_size} per micro-batch x {num_microbatches} "
                             f"micro-batches x dp {dp} = {self.global_size})")

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per epoch (a last partial one is left out)."""
        return len(self.dataset) // self.global_size

    def order(self, epoch: int) -> list[int]:
        if self.strategy == "sequential":
            return list(range(len(self.dataset)))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def epoch(self, epoch: int, skip_steps: int = 0) -> Iterator[list[dict] | None]:
        if not self.reads_data:
            yield from (None for _ in range(skip_steps, self.steps_per_epoch))
            return
        order, size = self.order(epoch), self.micro_batch_size
        steps = range(skip_steps, self.steps_per_epoch)
        indices = [order[start + mb * size:start + (mb + 1) * size]
                   for start in (step * self.global_size + self.dp_rank * self.local
                                 for step in steps)
                   for mb in range(self.num_microbatches)]
        # its own generator: a DataLoader draws its workers' base seed when iterated, which
        # from the global generator would shift dropout after a resume mid-epoch
        microbatches = iter(DataLoader(
            self.dataset, batch_sampler=indices, collate_fn=self.collate,
            generator=torch.Generator().manual_seed(self.seed + epoch), **self.loader))
        for _ in steps:
            yield [next(microbatches) for _ in range(self.num_microbatches)]


class EvalBatches:
    """Every item of an evaluation set once, in order, in steps of ``rows`` items per dp rank
    (`micro_batch_size` x `num_microbatches`): step k's global slice is items
    ``[k*G, (k+1)*G)`` with G = rows x dp, dp rank r taking its r-th share. The last step's
    shares are filled up to full micro-batches (the pipeline runs the shapes it was built for)
    with copies of item 0 whose labels are all -100; `real_rows` says how many rows of a share
    are data, and a rank's padding always follows its data.

    `per_microbatch` (a collator that makes several rows of an item, TRL's DPO one, or whose
    rows are joined, KTO's with `merak.trainer.joined_rows`): each micro-batch is collated from
    its own items, as in training, and a step is their list; the set must fill whole steps
    (`check_whole_steps`, before anything is built)."""

    def __init__(self, dataset, collate: Callable[[list], dict], *, micro_batch_size: int,
                 num_microbatches: int, dp: int, dp_rank: int, reads_data: bool,
                 label_names: Sequence[str] = ("labels",), per_microbatch: bool = False):
        self.dataset, self.collate = dataset, collate
        self.micro_batch_size, self.per_microbatch = micro_batch_size, per_microbatch
        self.rows = micro_batch_size * num_microbatches
        self.global_size = self.rows * dp
        self.dp_rank, self.reads_data, self.label_names = dp_rank, reads_data, label_names
        if len(dataset) == 0:
            raise ValueError("the evaluation dataset is empty")

    @property
    def steps(self) -> int:
        return -(-len(self.dataset) // self.global_size)

    def real_rows(self, step: int, dp_rank: int | None = None) -> int:
        start = step * self.global_size + (self.dp_rank if dp_rank is None else dp_rank) \
            * self.rows
        return max(0, min(self.rows, len(self.dataset) - start))

    def samples(self, steps: int) -> int:
        return min(len(self.dataset), steps * self.global_size)

    def step(self, step: int) -> dict | list[dict] | None:
        if not self.reads_data:
            return None
        start = step * self.global_size + self.dp_rank * self.rows
        real = self.real_rows(step)
        if self.per_microbatch:  # (whole steps: `check_whole_steps`)
            size = self.micro_batch_size
            return [self.collate([self.dataset[i] for i in range(first, first + size)])
                    for first in range(start, start + self.rows, size)]
        items = [self.dataset[i] for i in range(start, start + real)]
        batch = self.collate(items + [self.dataset[0]] * (self.rows - real))
        rows = {name: t.shape[0] for name, t in batch.items() if torch.is_tensor(t) and t.dim()}
        if any(n != self.rows for n in rows.values()):
            raise NotSupportedYetError(
                f"evaluation collates each evaluation step's {self.rows} rows in one call and "
                f"cuts them into micro-batches by row, but the data collator returned {rows} "
                f"rows (a padding-free or packing collator flattens a batch into one row; a "
                f"preference collator, TRL's reward and DPO ones, makes two rows per example); "
                f"evaluate with a collator that keeps one row per example (TRL: "
                f"padding_free=False and eval_packing=False)")
        if real < self.rows:
            for name in self.label_names:
                if name in batch:
                    batch[name] = batch[name].clone()
                    batch[name][real:] = -100
        return batch
