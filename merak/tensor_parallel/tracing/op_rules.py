"""How each torch op of a recorded block treats a sharded value, for
`merak.tensor_parallel.tracing.propagate` (the layout, `Shard`, is in `.shards`).

Each rule gets the walk (`propagate._Pass`: ``of``, ``set``, ``meet``, ``fail``, ``parts``,
``need_divided``, ``region``, ``tp``), the node and the op's name, and sets the shards of the
node's outputs, asks for what the replicated operands it meets along the sharded dim need
(``meet``), or fails with the reason. An op without a rule fails when it reads a sharded value.
"""

from __future__ import annotations

from torch.utils import _pytree as pytree

from merak.tensor_parallel.tracing.shards import (
    Shard,
    arg,
    dim_list,
    map_view,
    outputs,
    permutation,
    size_args,
    tensors,
)
from merak.tensor_parallel.tracing.trace import Node, Value

ACTIVATIONS = {"gelu", "silu", "relu", "tanh", "sigmoid", "softplus", "elu", "leaky_relu", "mish",
               "hardswish", "relu6", "selu", "celu", "erf", "hardsigmoid", "logsigmoid",
               "log_sigmoid",
               "softsign", "square", "pow", "glu", "exp", "sin"}
UNARY = {"contiguous", "clone", "detach", "to", "type", "float", "half", "bfloat16", "double",
         "type_as", "dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d",
         "neg", "__neg__", "abs", "log", "log1p", "sqrt", "rsqrt", "reciprocal", "sign",
         "nan_to_num", "requires_grad", "data", "cos", "zeros_like", "ones_like", "empty_like",
         "full_like", "rand_like", "randn_like", "__invert__", "logical_not", "isinf", "isnan",
         "floor", "ceil", "round", "trunc", "frac", "expm1", "exp2", "sinh", "cosh", "atan",
         "asin", "acos", "erfc", "sgn", "positive", "cpu", "cuda", "bool", "int", "long",
         *ACTIVATIONS - {"pow", "glu"}}
NARY = {"add", "sub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "pow",
        "maximum", "minimum", "where", "masked_fill", "lerp", "addcmul", "addcdiv", "clamp",
        "clip", "clamp_min", "clamp_max", "atan2", "eq", "ne", "lt", "gt", "le", "ge",
        "logical_and", "logical_or", "bitwise_and", "bitwise_or", "hypot", "xlogy", "copysign",
        "rsub"} | {f"__{o}__" for o in (
            "add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv",
            "rfloordiv", "mod", "pow", "rpow", "and", "or", "xor", "eq", "ne", "lt", "gt", "le",
            "ge", "iadd", "isub", "imul", "itruediv")}
VIEWS = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "unsqueeze", "squeeze",
         "expand", "expand_as", "broadcast_to"}
PERMUTES = {"transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "t", "T", "mT",
            "mH", "H"}
CREATE = {"zeros", "ones", "empty", "full", "new_zeros", "new_ones", "new_empty", "new_full",
          "arange"}


def unary(p, node: Node, name: str) -> None:
    src = node.args[0] if node.args else None
    s = p.of(src)
    if s is not None:
        for out in outputs(node):
            if out.shape == src.shape:
                p.set(out, s)


def nary(p, node: Node, name: str) -> None:
    outs = outputs(node)
    n = outs[0].ndim
    target = None
    for v in tensors(node):
        s = p.of(v)
        if s is None:
            continue
        cand = Shard(s.dim + n - v.ndim, s.pos, s.source)
        if target is None:
            target = cand
        elif (target.dim, target.pos) != (cand.dim, cand.pos):
            p.fail(node, "two values sharded differently meet")
        elif target.source != cand.source:
            target = Shard(target.dim, target.pos)
    for v in tensors(node):
        d = target.dim - (n - v.ndim)
        if p.of(v) is None and d >= 0 and v.shape[d] != 1:
            p.meet(node, v, d, target)
    for out in outs:
        if out.ndim == n:
            p.set(out, target)


def view(p, node: Node, name: str) -> None:
    x, out = node.args[0], outputs(node)[0]
    s = p.of(x)
    if s is None:  # only the shape's reference is sharded (mask.expand_as(scores))
        other = p.of(node.args[1]) if len(node.args) > 1 else None
        if name != "expand_as" or other is None:
            p.fail(node, f"{name} of a replicated value to a sharded one's shape")
        d = other.dim - (out.ndim - x.ndim)
        if d >= 0 and x.shape[d] != 1:
            p.meet(node, x, d, other)
        p.set(out, other)
        return
    if name in ("expand", "expand_as", "broadcast_to"):
        new = Shard(s.dim + out.ndim - x.ndim, s.pos, s.source)
        if out.shape[new.dim] != x.shape[s.dim]:
            p.fail(node, "expands the sharded dim")
    elif name == "view" and len(node.args) > 1 and not isinstance(node.args[1], (int, list,
                                                                                 tuple)):
        new = s if out.shape == x.shape else p.fail(node, "a dtype view of a sharded value")
    else:
        new = map_view(x.shape, out.shape, s, p.tp) or p.fused_view(node, x, s, out)
    if s.dim == x.ndim - 1 and new.dim != out.ndim - 1 and s.source is not None \
            and s.pos * p.tp == x.shape[s.dim] and out.shape[new.dim] > 1:
        p.region.fused_guesses.append((s.source, out.shape[new.dim]))
    sizes = size_args(node) if name in ("view", "reshape", "expand", "broadcast_to") else []
    if name == "unflatten":
        start = int(arg(node, 1, "dim")) % x.ndim
        sizes = [None] * start + list(arg(node, 2, "sizes"))
    if len(sizes) == out.ndim:
        p.need_divided(node, sizes[new.dim])
    if s.dim == x.ndim - 1 and new.dim != out.ndim - 1 and out.shape[new.dim] > 1:
        p.region.heads = True
        p.region.head_sizes.add(out.shape[new.dim])
    p.set(out, new)


def permute(p, node: Node, name: str) -> None:
    x, out = node.args[0], outputs(node)[0]
    s = p.of(x)
    p.set(out, Shard(permutation(node, name, x.ndim).index(s.dim), s.pos, s.source))


def split(p, node: Node, name: str) -> None:
    x, outs = node.args[0], outputs(node)
    s = p.of(x)
    d = int(arg(node, 1 if name == "unbind" else 2, "dim", 0)) % x.ndim
    if d != s.dim:
        for out in outs:
            p.set(out, Shard(s.dim - (name == "unbind" and d < s.dim), s.pos, s.source))
        return
    if name == "unbind":
        p.fail(node, "unbinds the sharded dim")
    if name in ("split", "split_with_sizes"):
        for size in pytree.tree_leaves(node.args[1] if len(node.args) > 1 else []):
            p.need_divided(node, size)
    start, spans = 0, []
    for out in outs:
        spans.append((start, start + out.shape[d]))
        start += out.shape[d]
    p.parts(node, x, s, spans, outs)


def getitem(p, node: Node, name: str) -> None:
    x, out = node.args[0], outputs(node)[0]
    s = p.of(x)
    items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if any(isinstance(i, Value) for i in items):
        p.fail(node, "indexes a sharded value with a tensor")
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    src, dst, new, span = 0, 0, None, None
    for item in items:
        count = x.ndim - used if item is Ellipsis else 1
        for _ in range(count):
            if item is None:
                dst += 1
                continue
            if src == s.dim:
                if isinstance(item, int):
                    p.fail(node, "picks one index of the sharded dim")
                new = dst
                if item is not Ellipsis:
                    start, stop, step = item.indices(x.shape[src])
                    if step != 1:
                        p.fail(node, "a strided slice of the sharded dim")
                    if (start, stop) != (0, x.shape[src]):
                        span = (start, stop)
                        p.need_divided(node, item.start)
                        p.need_divided(node, item.stop)
            src += 0 if item is None else 1
            dst += 0 if isinstance(item, int) else 1
    if new is None:
        new = dst + s.dim - src
    if span is not None:
        p.parts(node, x, s, [span], [out], dim=new)
    else:
        p.set(out, Shard(new, s.pos, s.source))


def reduce(p, node: Node, name: str) -> None:
    x = node.args[0]
    if name in ("max", "min") and len(node.args) > 1 and isinstance(node.args[1], Value):
        return nary(p, node, name)
    s = p.of(x)
    index = 2 if name in ("norm", "vector_norm") else 1
    dims = dim_list(arg(node, index, "dim"), x.ndim)
    if dims is None or s.dim in dims:
        p.fail(node, f"{name} over the sharded dim")
    keep = arg(node, index + 1, "keepdim", False)
    new = s.dim if keep else s.dim - sum(d < s.dim for d in dims)
    for out in outputs(node):
        p.set(out, Shard(new, s.pos))
    return None


def along(p, node: Node, name: str) -> None:
    x = node.args[0]
    s = p.of(x)
    dims = dim_list(arg(node, 2 if name == "normalize" else 1, "dim",
                     1 if name == "normalize" else None), x.ndim)
    if dims is None or s.dim in dims:
        p.fail(node, f"{name} along the sharded dim")
    unary(p, node, name)


def norm(p, node: Node, name: str) -> None:
    x = node.args[0]
    s = p.of(x)
    shape = arg(node, 1, "normalized_shape")
    width = len(shape) if isinstance(shape, (list, tuple)) else 1
    if s is None or s.dim >= x.ndim - width:
        p.fail(node, f"{name} over the sharded dim")
    unary(p, node, name)


def matmul(p, node: Node, name: str) -> None:
    if name == "baddbmm":
        extra, a, b = (arg(node, i, n) for i, n in enumerate(("input", "batch1", "batch2")))
    else:
        extra, a, b = None, arg(node, 0, "input"), arg(node, 1, "other")
    out = outputs(node)[0]
    n = out.ndim
    if a.ndim < 2 or b.ndim < 2:
        p.fail(node, f"{name} of a vector and a sharded value")
    target = None
    sa, sb = p.of(a), p.of(b)
    if sa is not None:
        if sa.dim == a.ndim - 1:
            p.fail(node, f"{name} contracts the sharded dim")
        target = Shard(n - 2 if sa.dim == a.ndim - 2 else sa.dim + n - a.ndim, sa.pos)
    if sb is not None:
        if sb.dim == b.ndim - 2:
            p.fail(node, f"{name} contracts the sharded dim")
        cand = Shard(n - 1 if sb.dim == b.ndim - 1 else sb.dim + n - b.ndim, sb.pos)
        if target is not None and target != cand:
            p.fail(node, f"{name} of two values sharded differently")
        target = cand
    others = [v for v in (a, b) if p.of(v) is None] if target.dim < n - 2 else []
    if extra is not None and p.of(extra) is None:
        others.append(extra)
    for v in others:
        d = target.dim - (n - v.ndim)
        if d >= 0 and v.shape[d] != 1:
            p.meet(node, v, d, target)
    p.set(out, target)


def sdpa(p, node: Node, name: str) -> None:
    q, k, v = (arg(node, i, n) for i, n in enumerate(("query", "key", "value")))
    mask = arg(node, 3, "attn_mask")
    s = p.of(q)
    if s is None or s.dim >= q.ndim - 2:
        p.fail(node, "attention with a sharded key or value or along a sharded feature")
    for t in (k, v, mask):
        if not isinstance(t, Value):
            continue
        st = p.of(t)
        d = s.dim - (q.ndim - t.ndim)
        if st is not None and (st.dim != d or st.pos * p.tp != t.shape[d]
                               or s.pos * p.tp != q.shape[s.dim]):
            p.fail(node, "attention over values sharded differently")
        if st is None and d >= 0 and t.shape[d] != 1:
            p.meet(node, t, d, s)
    p.set(outputs(node)[0], Shard(s.dim, s.pos))


def einsum(p, node: Node, name: str) -> None:
    equation = node.args[0].replace(" ", "")
    operands = list(node.args[1]) if len(node.args) == 2 and isinstance(
        node.args[1], (list, tuple)) else list(node.args[1:])
    if "..." in equation or "->" not in equation:
        p.fail(node, "an einsum with ellipsis or no output")
    lhs, rhs = equation.split("->")
    terms = lhs.split(",")
    letter, target = None, None
    for term, op in zip(terms, operands):
        s = p.of(op)
        if s is not None:
            if letter not in (None, term[s.dim]) or target and target.pos != s.pos:
                p.fail(node, "an einsum of values sharded differently")
            letter, target = term[s.dim], s
    if letter not in rhs:
        p.fail(node, "an einsum contracts the sharded dim")
    target = Shard(rhs.index(letter), target.pos)
    for term, op in zip(terms, operands):
        if p.of(op) is None and letter in term and op.shape[term.index(letter)] != 1:
            p.meet(node, op, term.index(letter), target)
    p.set(outputs(node)[0], target)


def cat(p, node: Node, name: str) -> None:
    parts = list(arg(node, 0, "tensors"))
    dim = int(arg(node, 1, "dim", 0))
    target = None
    for v in parts:
        s = p.of(v)
        if s is not None:
            if target is not None and (target.dim, target.pos) != (s.dim, s.pos):
                p.fail(node, f"{name} of values sharded differently")
            target = Shard(s.dim, s.pos)
    if name == "cat" and dim % parts[0].ndim == target.dim:
        p.fail(node, "cat along the sharded dim")
    for v in parts:
        if p.of(v) is None and v.shape[target.dim] != 1:
            p.meet(node, v, target.dim, target)
    if name == "stack" and dim % (parts[0].ndim + 1) <= target.dim:
        target = Shard(target.dim + 1, target.pos)
    p.set(outputs(node)[0], target)


def same_unless(p, node: Node, name: str) -> None:
    """Ops that keep shapes and must not touch the sharded dim (flip, roll, tril, pad, ...)."""
    x = node.args[0]
    s = p.of(x)
    nd = x.ndim
    if name in ("tril", "triu"):
        bad = s.dim >= nd - 2
    elif name == "pad":
        pad = list(arg(node, 1, "pad"))
        bad = any(pad[i] or pad[i + 1] for i in range(0, len(pad), 2) if nd - 1 - i // 2 == s.dim)
    elif name == "repeat":
        sizes = size_args(node)
        offset = len(sizes) - nd
        bad = sizes[s.dim + offset] != 1
        s = Shard(s.dim + offset, s.pos, s.source)
    else:  # flip, roll, repeat_interleave
        dims = dim_list(arg(node, 1 if name == "flip" else 2, "dims" if name != "repeat_interleave"
                         else "dim"), nd)
        bad = dims is None or s.dim in dims
    if bad:
        p.fail(node, f"{name} touches the sharded dim")
    for out in outputs(node):
        p.set(out, s)


def narrow(p, node: Node, name: str) -> None:
    x = node.args[0]
    s = p.of(x)
    dim = int(arg(node, 1, "dim")) % x.ndim
    if name == "select":
        if dim == s.dim:
            p.fail(node, "picks one index of the sharded dim")
        return p.set(outputs(node)[0], Shard(s.dim - (dim < s.dim), s.pos, s.source))
    if dim != s.dim:
        return p.set(outputs(node)[0], s)
    start, length = int(node.args[2]), int(node.args[3])
    return p.parts(node, x, s, [(start, start + length)], outputs(node))


def conv(p, node: Node, name: str) -> None:
    """A depthwise convolution (one group per channel) over channels sharded along dim 1: each
    rank convolves its channels with its slice of the weight (Mamba's mixer)."""
    x, out = node.args[0], outputs(node)[0]
    s = p.of(x)
    groups = arg(node, 6, "groups", 1)
    if s is None or s.dim != 1 or int(groups) != x.shape[1] or out.shape[1] != x.shape[1]:
        p.fail(node, f"{name} mixes the sharded channels")
    p.need_divided(node, groups)
    for t in (arg(node, 1, "weight"), arg(node, 2, "bias")):
        if isinstance(t, Value) and p.of(t) is None:
            p.meet(node, t, 0, s)
    p.set(out, Shard(1, s.pos))


def generic_linear(p, node: Node, name: str) -> None:
    x = node.args[0]
    s = p.of(x)
    if s is None or s.dim == x.ndim - 1:
        p.fail(node, "a linear map of a weight that is no linear layer's reads a sharded dim")
    p.set(outputs(node)[0], s)


def nothing(p, node: Node, name: str) -> None:
    """Ops whose outputs do not carry the sharded values (new_zeros of a sharded tensor)."""


RULES = {
    **dict.fromkeys(UNARY, unary), **dict.fromkeys(NARY, nary),
    **dict.fromkeys(VIEWS, view), **dict.fromkeys(PERMUTES, permute),
    **dict.fromkeys(("split", "split_with_sizes", "chunk", "tensor_split", "unbind"), split),
    **dict.fromkeys(("sum", "mean", "amax", "amin", "max", "min", "prod", "norm", "var", "std",
                     "logsumexp", "all", "any", "vector_norm", "nansum", "nanmean", "argmax",
                     "argmin", "count_nonzero"), reduce),
    **dict.fromkeys(("softmax", "log_softmax", "cumsum", "cumprod", "_softmax", "normalize"),
                    along),
    **dict.fromkeys(("layer_norm", "rms_norm"), norm),
    **dict.fromkeys(("matmul", "__matmul__", "bmm", "baddbmm"), matmul),
    **dict.fromkeys(("cat", "concat", "concatenate", "stack"), cat),
    **dict.fromkeys(("flip", "roll", "tril", "triu", "pad", "repeat", "repeat_interleave"),
                    same_unless),
    **dict.fromkeys(("narrow", "select"), narrow),
    **dict.fromkeys(CREATE, nothing),
    "__getitem__": getitem, "scaled_dot_product_attention": sdpa, "einsum": einsum,
    "linear": generic_linear, "conv1d": conv, "conv2d": conv,
}
