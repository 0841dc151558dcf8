"""The key under which `trace_cache` keeps a capture: everything the capture depends on.

`trace_key` fingerprints a model (each module's path, class and plain attributes, hooks
included; each parameter's and buffer's name, shape, stride, dtype, device, requires_grad and
which names alias one tensor), the example inputs (names, shapes, strides, dtypes, devices,
which inputs alias), the capture options and the global torch state a trace reads (grad mode,
autocast, default dtype). Two builds with equal keys trace to the same graph.

It errs on the side of a miss: an attribute of a kind it cannot fingerprint by value (an
arbitrary object, a tensor that is not the model's own, too deep a nesting) makes the
whole key None, and a None key is never cached or looked up. A class's ``forward`` is part of
the key (a test may patch it); other code the trace runs (module-level helpers of a modeling
file) is not: patching those between two builds in one process needs ``MERAK_TRACE_CACHE=0``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
from collections.abc import Mapping

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

_MAX_DEPTH = 8
# nn.Module bookkeeping read separately (tensors, children) or irrelevant to a trace; and
# `_weight_conversions`, how transformers' `from_pretrained` renamed and merged the file's
# tensors (read again by `save_pretrained`, never by a forward)
_MODULE_SKIP = {"_parameters", "_buffers", "_modules", "_state_dict_hooks",
                "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                "_load_state_dict_post_hooks", "_weight_conversions"}
# fields of `merak.tensor_parallel.apply.convert.TPInfo` that the capture never reads (the unsharded
# examples a plan is proven on after the split): left out, since they hold modules and tensors
_SKIP_FIELDS = {"TPInfo": {"examples"}}
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.layout, torch.memory_format, torch.Size, range, slice, type(Ellipsis))


class _Uncertain(Exception):
    """A value the key cannot fingerprint: no key (no reuse)."""


class _Fingerprint:
    """Value fingerprints of one model's attributes; modules and tensors of the model itself
    are named by their path, anything else foreign is uncertain."""

    def __init__(self, model: nn.Module):
        self.module_paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
        self.tensor_names = {}
        for name, t in [*model.named_parameters(remove_duplicate=False),
                        *model.named_buffers(remove_duplicate=False)]:
            self.tensor_names.setdefault(id(t), name)
        self.memo: dict[int, tuple] = {}  # id -> (object, fingerprint)
        self.active: list[int] = []  # the objects being fingerprinted, outermost first
        self.cycles = 0

    def value(self, v, depth: int = 0):
        if isinstance(v, _PLAIN):
            return (type(v), v)
        if isinstance(v, enum.Enum):
            return (type(v), v.name)
        if isinstance(v, type):
            return ("type", v)
        if isinstance(v, nn.Module):
            if id(v) in self.module_paths:
                return ("module", self.module_paths[id(v)])
            raise _Uncertain(f"a module outside the model: {type(v).__name__}")
        if isinstance(v, torch.Tensor):
            if id(v) in self.tensor_names:
                return ("tensor", self.tensor_names[id(v)])
            raise _Uncertain("a tensor attribute that is no parameter or buffer")
        if depth > _MAX_DEPTH:
            raise _Uncertain("nested too deep")
        if id(v) in self.memo:
            return self.memo[id(v)][1]
        if id(v) in self.active:  # a function whose closure holds itself, say: a back-reference
            self.cycles += 1
            return ("cycle", len(self.active) - self.active.index(id(v)))
        self.active.append(id(v))
        cycles = self.cycles
        try:
            fp = self._composite(v, depth + 1)
        finally:
            self.active.pop()
        if self.cycles == cycles:  # a back-reference is relative to the path: not memoized
            self.memo[id(v)] = (v, fp)  # v kept alive: its id is not reused meanwhile
        return fp

    def _composite(self, v, depth: int):
        if isinstance(v, (tuple, list)):
            return (type(v), tuple(self.value(x, depth) for x in v))
        if isinstance(v, (set, frozenset)):
            return (type(v), tuple(sorted((self.value(x, depth) for x in v), key=repr)))
        if isinstance(v, Mapping):
            items = [(self.value(k, depth), self.value(x, depth)) for k, x in v.items()]
            return (type(v), tuple(items))  # insertion order counts (hooks run in it)
        if isinstance(v, functools.partial):
            return ("partial", self.value(v.func, depth), self.value(v.args, depth),
                    self.value(v.keywords, depth))
        if isinstance(v, types.MethodType):
            return ("method", self.value(v.__func__, depth), self.value(v.__self__, depth))
        if isinstance(v, types.FunctionType):
            cells = tuple(self.value(c.cell_contents, depth) for c in v.__closure__ or ())
            return ("function", v.__code__, cells, self.value(v.__defaults__, depth),
                    self.value(v.__kwdefaults__, depth))
        if isinstance(v, (types.BuiltinFunctionType, types.BuiltinMethodType,
                          torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return ("builtin", v)
        if _is_process_group(v):
            import torch.distributed as dist

            return ("group", v.size(), v.rank(), tuple(dist.get_process_group_ranks(v)))
        if dataclasses.is_dataclass(v):
            skip = _SKIP_FIELDS.get(type(v).__name__, set())
            return (type(v), tuple((f.name, self.value(getattr(v, f.name), depth))
                                   for f in dataclasses.fields(v) if f.name not in skip))
        state = getattr(v, "__dict__", None)
        if isinstance(state, dict) and type(v).__module__.split(".")[0] in (
                "transformers", "merak"):  # configs, plans: plain attribute holders
            return (type(v), self.value(state, depth))
        raise _Uncertain(f"an attribute of type {type(v).__qualname__}")

    def module(self, path: str, m: nn.Module) -> tuple:
        """Path, class, the class's forward as it is now (a test may patch it) and the plain
        attributes, hooks included."""
        attrs = tuple((k, self.value(v)) for k, v in vars(m).items() if k not in _MODULE_SKIP)
        return (path, type(m), self.value(type(m).forward), attrs)


def _is_process_group(v) -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # a torch built without distributed
        return False
    return dist.is_available() and isinstance(v, dist.ProcessGroup)


def _tensor(t: torch.Tensor) -> tuple:
    return (type(t), tuple(t.shape), t.stride(), t.dtype, t.device, t.layout, t.requires_grad)


def _model(model: nn.Module) -> tuple:
    fp = _Fingerprint(model)
    modules = tuple(fp.module(p, m) for p, m in model.named_modules(remove_duplicate=False))
    tensors = []
    for kind, named in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in named:  # aliases: the first name of the same tensor
            tensors.append((kind, name, fp.tensor_names[id(t)], _tensor(t)))
    hooks = nn.modules.module
    global_hooks = tuple(fp.value(dict(getattr(hooks, h, {}))) for h in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
        "_global_module_registration_hooks", "_global_parameter_registration_hooks",
        "_global_buffer_registration_hooks"))
    return (modules, tuple(tensors), global_hooks)


def _inputs(example_inputs: dict) -> tuple:
    out, storages = [], {}
    for k, v in example_inputs.items():
        if isinstance(v, torch.Tensor):
            alias = k  # which inputs share memory (the capture clones aliased real ones)
            if not isinstance(v, FakeTensor) and v.device.type != "meta":
                where = (v.untyped_storage().data_ptr(), v.storage_offset())
                alias = storages.setdefault(where, k)
            out.append((k, _tensor(v), alias))
        elif isinstance(v, _PLAIN):
            out.append((k, (type(v), v)))
        else:
            raise _Uncertain(f"example input {k!r} of type {type(v).__qualname__}")
    return tuple(out)


def _torch_state() -> tuple:
    autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                     for d in ("cpu", "cuda"))
    return (torch.__version__, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(), autocast)


def trace_key(model: nn.Module, example_inputs: dict, options: tuple) -> tuple | None:
    """The capture key of `model` traced on `example_inputs` with `options` (blocks, leaf
    modules, trace method, dynamic settings: plain values); None when anything is uncertain."""
    try:
        return (options, _model(model), _inputs(example_inputs), _torch_state())
    except _Uncertain:
        return None
