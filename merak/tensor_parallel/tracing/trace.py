"""One block's forward recorded op by op, for plan inference (`merak.tensor_parallel.apply.infer`).

The model runs once on a small batch, its parameters and buffers swapped for fake tensors on the
device it will train on (`FakeWeights`: no memory, no compute, and transformers takes its
tracing paths, which read no tensor's values), with a forward pre-hook on its blocks, which
keeps the inputs of the first block of each structure (`signature`) with the model's real call
signature. Each such block then runs again on those inputs under a `TorchFunctionMode` that
records every torch call: its function, its arguments with tensors replaced by `Value` records,
its outputs, and the innermost module running it. Integer attributes of the block's modules and
of their configs are replaced by `TrackedInt` for that run, so an argument such as
``view(b, s, self.num_heads, d)`` says which attribute each size came from. Which of the
block's outputs the model reads later is recorded during the first run (attention
probabilities are returned but read only when asked).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from merak.materialize.fake_weights import FakeWeights, traceable_experts
from merak.stages.blocks import find_blocks

BATCH, SEQ = 2, 8
SHAPE = "#shape"  # the owner of a `TrackedInt` source read from a tensor's shape


class TrackedInt(int):
    """An int that remembers the attributes it was computed from (``sources``: a frozenset of
    (owner path, attribute) pairs); arithmetic with other ints keeps them."""

    sources: frozenset

    def __new__(cls, value: int, sources) -> TrackedInt:
        obj = int.__new__(cls, value)
        obj.sources = frozenset(sources)
        return obj

    def __repr__(self) -> str:
        names = sorted(a for o, a in self.sources if o != SHAPE)
        return f"{int(self)}<{','.join(names)}>" if names else str(int(self))


def _tracked(op, reflected: bool = False):
    def method(self, other):
        if isinstance(other, bool) or not isinstance(other, int):
            return NotImplemented
        a, b = (int(other), int(self)) if reflected else (int(self), int(other))
        return TrackedInt(op(a, b), self.sources | getattr(other, "sources", frozenset()))
    return method


for _name, _op in (("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("floordiv", operator.floordiv), ("mod", operator.mod)):
    setattr(TrackedInt, f"__{_name}__", _tracked(_op))
    setattr(TrackedInt, f"__r{_name}__", _tracked(_op, reflected=True))
TrackedInt.__neg__ = lambda self: TrackedInt(-int(self), self.sources)
TrackedInt.__pos__ = lambda self: self
TrackedInt.__abs__ = lambda self: TrackedInt(abs(int(self)), self.sources)


def sources_of(value) -> frozenset:
    return getattr(value, "sources", frozenset())


@dataclass(eq=False)
class Value:
    """A tensor seen in the trace: made by node `producer` (None: from outside the ops, see
    `origin`: ``input``, ``param:<name>``, ``buffer:<name>`` or ``other``)."""

    shape: tuple[int, ...]
    floating: bool
    producer: int | None
    origin: str
    index: int = 0  # which output of the producer (flat)
    requires_grad: bool = False  # a gradient flows through it in training

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(eq=False)
class Node:
    index: int
    name: str  # the torch function's name: "linear", "view", "__getitem__", ...
    args: tuple  # the call's arguments, tensors as `Value`s
    kwargs: dict
    outputs: list  # flat outputs: `Value` or a non-tensor
    module: str  # the innermost module running it, relative to the block ("" = the block)


@dataclass
class BlockTrace:
    """One block's recorded forward (see the module docstring)."""

    block: str  # the block's qualified name
    nodes: list[Node]
    inputs: list[tuple[str, Value]]  # (pytree path of the call's argument, its value)
    outputs: list[tuple[Value | None, bool]]  # flat outputs: (value, read later by the model)
    params: dict[int, str] = field(default_factory=dict)  # id(Value) -> parameter, relative
    shapes: dict[str, tuple[Value, int]] = field(default_factory=dict)  # (SHAPE, key) sources


def named_inputs(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """A call's arguments by the names of ``module.forward``'s parameters (those ``**kwargs``
    gathers by their own names), however the caller passed them: an input's path in this dict
    (``['alibi']``, ``['position_embeddings'][0]``) names it for every call."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    named = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            named.update({f"{name}{i}": v for i, v in enumerate(value)})
        else:
            named[name] = value
    return named


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of `module` whose parameters and buffers are new tensors on the meta device
    (what else the originals carry, such as a meta build's record, is not copied)."""
    memo: dict[int, object] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                   p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    return copy.deepcopy(module, memo)


def signature(block: nn.Module) -> tuple:
    """A block's structure: its class and its submodules' names and classes."""
    return (type(block).__name__,
            tuple((n, type(m).__name__) for n, m in block.named_modules() if n))


class _UseRecorder(TorchFunctionMode):
    """Notes when each tensor was last read by a torch call (a count of the calls)."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.last_read: dict[int, int] = {}
        self.keep: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        for leaf in pytree.tree_leaves((args, kwargs or {})):
            if isinstance(leaf, torch.Tensor):
                self.last_read[id(leaf)] = self.calls
                self.keep.append(leaf)
        return func(*args, **(kwargs or {}))


def capture_blocks(model: nn.Module, blocks: list[str], ids: torch.Tensor
                   ) -> dict[str, tuple[tuple, dict, list[bool]]]:
    """The first block of each `signature`: block name -> (its args, its kwargs, for each flat
    output whether the model reads it later), from one forward of `model` on `ids`."""
    seen: dict[tuple, str] = {}
    for name in blocks:
        seen.setdefault(signature(model.get_submodule(name)), name)
    chosen = set(seen.values())
    captured: dict[str, list] = {}
    uses = _UseRecorder()
    handles = []
    for name in chosen:
        module = model.get_submodule(name)

        def pre(mod, args, kwargs, name=name):
            captured.setdefault(name, [args, kwargs, None])

        def post(mod, args, kwargs, out, name=name):
            if captured[name][2] is None:
                captured[name][2:] = [out, uses.calls]
                uses.keep.append(out)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        # with grad: the captured inputs say which of them carry a gradient in training
        with torch.enable_grad(), torch.random.fork_rng(devices=[]), uses:
            extra = {"use_cache": False} \
                if "use_cache" in inspect.signature(model.forward).parameters else {}
            result = model(input_ids=ids, **extra)
    finally:
        for h in handles:
            h.remove()
    final = {id(t) for t in pytree.tree_leaves(plain(result)) if isinstance(t, torch.Tensor)}
    out = {}
    for name, (args, kwargs, output, end) in captured.items():
        flat = pytree.tree_leaves(plain(output))
        out[name] = (args, kwargs, [isinstance(t, torch.Tensor) and (
            uses.last_read.get(id(t), 0) > end or id(t) in final) for t in flat])
    return out


def plain(value):
    """ModelOutput and other dict-likes as plain dicts, for pytree."""
    if isinstance(value, dict) and type(value) is not dict:
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(plain(v) for v in value) if type(value) in (list, tuple) \
            else [plain(v) for v in value]
    return value


class _Recorder(TorchFunctionMode):
    def __init__(self, values: dict[int, Value], stack: list[str]):
        super().__init__()
        self.values, self.stack = values, stack
        self.nodes: list[Node] = []
        self.keep: list = []
        self.shapes: dict[str, tuple[Value, int]] = {}

    def _sizes(self, tensor: torch.Tensor, shape: torch.Size) -> torch.Size:
        """``tensor.shape`` as `TrackedInt`s naming the tensor's dims they were read from."""
        value = self._as_value(tensor)

        def tracked(dim: int, size: int) -> TrackedInt:
            key = f"{id(value)}:{dim}"
            self.shapes[key] = (value, dim)
            return TrackedInt(size, {(SHAPE, key)})
        return torch.Size(tracked(d, n) for d, n in enumerate(shape))

    def _as_value(self, leaf):
        if isinstance(leaf, torch.Tensor):
            value = self.values.get(id(leaf))
            if value is None:  # a tensor made outside the recorded ops (a constant)
                value = self.values[id(leaf)] = Value(tuple(leaf.shape), leaf.is_floating_point(),
                                                      None, "other")
                self.keep.append(leaf)
            return value
        return leaf

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", None) or str(func)
        if name == "__get__":  # a tensor attribute: kept when it is a tensor (x.T, x.data)
            name = getattr(getattr(func, "__self__", None), "__name__", name)
            if name == "shape" and isinstance(out, torch.Size) and args:
                return self._sizes(args[0], out)
            if not isinstance(out, torch.Tensor):
                return out
        elif name == "__set__":
            return out
        elif name == "size" and args and isinstance(args[0], torch.Tensor):
            if isinstance(out, torch.Size):
                return self._sizes(args[0], out)
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            return self._sizes(args[0], args[0].shape)[dim]
        rec_args, rec_kwargs = pytree.tree_map(self._as_value, (args, kwargs))
        index = len(self.nodes)
        flat = pytree.tree_leaves(out)
        outputs = []
        for i, leaf in enumerate(flat):
            if isinstance(leaf, torch.Tensor):
                value = Value(tuple(leaf.shape), leaf.is_floating_point(), index, "op", i,
                              leaf.requires_grad)
                self.values[id(leaf)] = value
                self.keep.append(leaf)
                outputs.append(value)
            else:
                outputs.append(leaf)
        self.nodes.append(Node(index, name, tuple(rec_args), rec_kwargs, outputs,
                               self.stack[-1] if self.stack else ""))
        return out


@contextlib.contextmanager
def _tracked_attributes(block: nn.Module):
    """Every int attribute of the block's modules as a `TrackedInt` naming it (module path,
    attribute), and each module's config replaced by a copy whose int attributes name
    ``config@<module path>``, so a size read from a config says which module read it; all put
    back afterwards."""
    saved = []
    for path, module in block.named_modules():
        for attr, value in list(vars(module).items()):
            if type(value) is int:
                saved.append((module, attr, value))
                object.__setattr__(module, attr, TrackedInt(value, {(path, attr)}))
        config = vars(module).get("config")
        if config is not None and hasattr(config, "to_dict"):
            mine = copy.copy(config)
            for attr, value in list(vars(config).items()):
                if type(value) is int:
                    object.__setattr__(mine, attr, TrackedInt(value, {("config@" + path, attr)}))
            saved.append((module, "config", config))
            object.__setattr__(module, "config", mine)
    try:
        yield
    finally:
        for owner, attr, value in reversed(saved):
            object.__setattr__(owner, attr, value)


def trace_block(model: nn.Module, name: str, args: tuple, kwargs: dict,
                read_later: list[bool]) -> BlockTrace:
    """Record block `name` of `model` run on `args` / `kwargs` (see `capture_blocks`)."""
    block = model.get_submodule(name)
    values: dict[int, Value] = {}
    params: dict[int, str] = {}
    for pname, p in block.named_parameters(remove_duplicate=False):
        values[id(p)] = Value(tuple(p.shape), p.is_floating_point(), None, "param:" + pname)
        params[id(values[id(p)])] = pname
    for bname, b in block.named_buffers(remove_duplicate=False):
        values[id(b)] = Value(tuple(b.shape), b.is_floating_point(), None, "buffer:" + bname)
    leaves, _ = pytree.tree_flatten_with_path(named_inputs(block, args, kwargs))
    inputs = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor) and id(leaf) not in values:
            values[id(leaf)] = Value(tuple(leaf.shape), leaf.is_floating_point(), None, "input",
                                     requires_grad=leaf.requires_grad)
            inputs.append((pytree.keystr(path), values[id(leaf)]))
    stack: list[str] = []
    names = {id(m): n for n, m in block.named_modules()}

    def enter(mod, args):
        if id(mod) in names:
            stack.append(names[id(mod)])

    def leave(mod, args, out):
        if id(mod) in names and stack:
            stack.pop()

    recorder = _Recorder(values, stack)
    pre = nn.modules.module.register_module_forward_pre_hook(enter)
    post = nn.modules.module.register_module_forward_hook(leave, always_call=True)
    try:
        # with grad, as in training: each value says whether a gradient flows through it
        with torch.enable_grad(), torch.random.fork_rng(devices=[]), \
                _tracked_attributes(block), recorder:
            out = block(*args, **kwargs)
    finally:
        pre.remove()
        post.remove()
    flat = pytree.tree_leaves(plain(out))
    outputs = [(values.get(id(t)) if isinstance(t, torch.Tensor) else None,
                read_later[i] if i < len(read_later) else True) for i, t in enumerate(flat)]
    return BlockTrace(name, recorder.nodes, inputs, outputs, params, recorder.shapes)


@contextlib.contextmanager
def fake_run(model: nn.Module, device: torch.device | str = "cpu"):
    """Inside: `model`'s parameters and buffers are fake tensors on `device` (see the module
    docstring); yields the token ids of the small batch it runs on. What the runs inside set on
    the modules (caches, recurrent states) is put back as it was."""
    saved = [(m, dict(vars(m))) for m in model.modules()]
    try:
        with traceable_experts(model), FakeWeights(model, device) as fake, fake.mode:
            yield torch.arange(BATCH * SEQ, device=device).remainder(7).add(3).view(BATCH, SEQ)
    finally:
        for module, before in saved:
            for key in [k for k in vars(module) if k not in before]:
                delattr(module, key)
            for key, value in before.items():
                if vars(module).get(key) is not value:
                    object.__setattr__(module, key, value)


def trace_model_blocks(model: nn.Module, device: torch.device | str = "cpu"
                       ) -> tuple[list[str], dict[str, BlockTrace]]:
    """The model's blocks and a trace of the first block of each structure, the model run as
    if on `device` (see the module docstring)."""
    blocks = find_blocks(model)
    if not blocks:
        return [], {}
    with fake_run(model, device) as ids:
        captured = capture_blocks(model, blocks, ids)
        traces = {name: trace_block(model, name, *c) for name, c in captured.items()}
    return blocks, traces


def describe(node: Node) -> str:
    def show(v: Any):
        return f"T{list(v.shape)}" if isinstance(v, Value) else repr(v)
    args = ", ".join(show(a) for a in pytree.tree_leaves(node.args))
    return f"#{node.index} {node.module or '<block>'}: {node.name}({args})"
