"""The user functions' shared argument handling: checks that name the argument, flash-attn's
layout accommodations (head-dim padding, contiguous copies, packed tensors), dropout state and the
return forms."""

from __future__ import annotations

import math
import operator

import torch

from . import ops


def _kernel_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """flash-attn's Python-side accommodations, so that its calls port unchanged: a last dimension
    whose stride is not 1 is copied contiguous (flash-attn's maybe_contiguous); a head dim that is
    not a multiple of 8 is zero-padded to the next multiple (flash-attn's wrapper); and values of
    another head dim than the queries' and keys' (multi-head latent attention: DeepSeek-V2 / V3,
    FlashAttention-3's hdim_v) pad both to the larger. Zero columns change neither the scores q.k
    nor the output's other columns, and autograd takes the gradients back through the pad.
    Returns (q, k, v, the output's head dim: v's); ``_cut`` cuts the output back. The ops
    themselves take neither (a clear error names the argument)."""
    q, k, v = _maybe_contiguous(q, k, v)
    if min(q.dim(), k.dim(), v.dim()) < 3:
        return q, k, v, v.shape[-1] if v.dim() else 0  # the op's rank check names the argument
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if k.shape[-1] != d_qk:
        raise RuntimeError(f"flash_attn_ext: k has headdim {k.shape[-1]} but q has {d_qk}; expected equal (v's may "
                           "differ)")
    for name, d in (("q", d_qk), ("v", d_v)):
        if not 0 < d <= 256:
            raise RuntimeError(f"flash_attn_ext: headdim {d} ({name}.size(-1)) is not supported; expected 1..256 "
                               "(one that is not a multiple of 8 runs zero-padded)")
    d = -(-max(d_qk, d_v) // 8) * 8
    q, k, v = (t if t.shape[-1] == d else torch.nn.functional.pad(t, (0, d - t.shape[-1])) for t in (q, k, v))
    return q, k, v, d_v


def _maybe_contiguous(*tensors):
    """flash-attn's maybe_contiguous: each tensor whose last dimension has a stride other than 1
    copied contiguous (None and 0-d tensors as they are). A clone, not ``.contiguous()``, which
    returns a tensor torch already calls contiguous as it is, stride included: an empty one, or one
    whose last dimension has size 1 (the ops require stride(-1) == 1 regardless)."""
    return tuple(t if t is None or t.dim() == 0 or t.stride(-1) == 1 else t.clone(memory_format=torch.contiguous_format)
                 for t in tensors)


def _cut(out: torch.Tensor, d: int) -> torch.Tensor:
    """The output of a ``_kernel_layout`` call back at the caller's head dim d (contiguous)."""
    return out if out.shape[-1] == d else out[..., :d].contiguous()


def _sinks(sinks) -> torch.Tensor | None:
    """sinks as the ops take them: None, or float32 (a differentiable cast). TypeError unless a
    tensor or None; RuntimeError naming sinks for a dtype that is not floating. Shape and device
    are the op's checks (their messages name sinks too)."""
    if sinks is None:
        return None
    _check_tensors(sinks=sinks)
    if not sinks.is_floating_point():
        raise RuntimeError(f"flash_attn_ext: sinks has dtype {sinks.dtype}; expected a floating dtype (one logit "
                           "per query head)")
    return sinks if sinks.dtype == torch.float32 else sinks.to(torch.float32)


def _window(window_size) -> tuple[int, int]:
    """window_size as (left, right) Python ints: TypeError unless a pair (tuple or list) of ints,
    RuntimeError naming the side below -1 (the op's message, with the value given: one past int64
    would not reach the op). One past any sequence length (>= 2^62) is the same bound as 2^62,
    which the op's int64 argument holds."""
    if type(window_size) is tuple and len(window_size) == 2:  # the common case, checked cheaply (eager
        left, right = window_size                              # calls pay this per attention layer)
        if type(left) is int and type(right) is int and -1 <= left <= 2**62 and -1 <= right <= 2**62:
            return window_size
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise TypeError(f"flash_attn_ext: window_size must be a pair (left, right) of ints, got {window_size!r}")
    sides = []
    for i, side in enumerate(("left", "right")):
        value = _as_int(f"window_size[{i}]", window_size[i])
        if value < -1:
            raise RuntimeError(f"flash_attn_ext: window_size_{side} must be -1 (no {side} bound) or >= 0, got {value}")
        sides.append(min(value, 2**62))
    return tuple(sides)


def _scale(name: str, value, q: torch.Tensor) -> float:
    """softmax_scale as a Python float: None -> 1 / sqrt(headdim); else a real number (``_real``)."""
    if value is None:
        # headdim 0 is rejected by the op with a message naming headdim; don't divide by zero first.
        return 1.0 / math.sqrt(q.shape[-1]) if q.dim() > 0 and q.shape[-1] > 0 else 1.0
    return _real(name, value)


def _real(name: str, value) -> float:
    """``value`` as a Python float: a real number (int, float, NumPy or 0-dim real tensor), not a
    bool, None or a string, or TypeError naming ``name`` (also for a tensor that requires grad: the
    kernels take the value as a constant)."""
    if type(value) is float:  # the common case; under torch.compile(dynamic=True) a symbolic float
        return value              # (no message is formatted on it: that would break the graph)

    def error():
        return TypeError(f"flash_attn_ext: {name} must be a real number, got {type(value).__name__} {value!r}")

    non_real_tensor = isinstance(value, torch.Tensor) and (value.is_complex() or value.dtype == torch.bool)
    if isinstance(value, (bool, str, bytes, complex)) or _is_numpy_bool(value) or non_real_tensor:
        raise error()
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        raise TypeError(f"flash_attn_ext: {name} must be a real number or a 0-dim tensor, got a tensor of shape "
                        f"{tuple(value.shape)}")
    if isinstance(value, torch.Tensor) and value.requires_grad:
        raise TypeError(f"flash_attn_ext: {name} is a tensor that requires grad, but it is a constant of the "
                        "kernels (no gradient reaches it); pass a float or a detached tensor")
    if isinstance(value, torch.Tensor) and torch.compiler.is_compiling():
        # Its value is data while tracing, and the ops take a float: a graph break reads it eagerly
        # (under fullgraph=True, Dynamo's error carries this message).
        torch._dynamo.graph_break(msg=f"flash_attn_ext: {name} is a tensor; under torch.compile pass a Python "
                                      f"float (the ops take {name} as a float, a tensor's value is data)")
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise error() from None
    except OverflowError:  # an int past float64's range
        raise TypeError(f"flash_attn_ext: {name} must be a real number within float64's range, got "
                        f"{type(value).__name__} {value!r}") from None


def _check_tensors(_optional=(), **tensors) -> None:
    """TypeError naming the first argument that is not a torch.Tensor (None allowed for the names
    in ``_optional``) or NotImplementedError naming the first nested (jagged) or non-strided (sparse,
    mkldnn) tensor: the ops take dense tensors (the packed form of ragged batches is
    flash_attn_varlen_func's)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) and not (t is None and name in _optional):
            expected = "a torch.Tensor or None" if name in _optional else "a torch.Tensor"
            raise TypeError(f"flash_attn_ext: {name} must be {expected}, got {type(t).__name__}")
        if isinstance(t, torch.Tensor) and t.is_nested:
            raise NotImplementedError(
                f"flash_attn_ext: {name} is a nested tensor; the attention functions take dense tensors. "
                "For a ragged batch pass the packed rows (nt.values()) with cu_seqlens (nt.offsets(), int32) to "
                "flash_attn_varlen_func")
        if isinstance(t, torch.Tensor) and t.layout != torch.strided:
            raise NotImplementedError(
                f"flash_attn_ext: {name} has layout {t.layout}; the attention functions take strided (dense) "
                f"tensors: pass {name}.to_dense()")


def _is_numpy_bool(value) -> bool:
    """A NumPy bool scalar (numpy.bool in NumPy 2, numpy.bool_ in 1), without importing NumPy."""
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def _as_int(name: str, value) -> int:
    """``value`` as a Python int (ints and integer scalars such as numpy.int64; not floats, not
    bool), or TypeError naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"flash_attn_ext: {name} must be an int, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"flash_attn_ext: {name} must be an int, got {type(value).__name__} {value!r}") from None


def _as_size(name: str, value):
    """``value`` as ``_as_int`` takes it, or a ``torch.SymInt`` as is: a size the ops' schemas declare
    SymInt (max_seqlen_q / max_seqlen_k), which torch.compile keeps symbolic instead of compiling
    one graph per value (operator.index would specialize it)."""
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        return value  # (torch.compile traces a varying int as an int: operator.index would guard on its value)
    return _as_int(name, value)


def _as_bool(name: str, value) -> bool:
    """``value`` as a Python bool (a bool, numpy.bool_, or an integer 0 / 1), or TypeError naming
    ``name``: a string such as ``'no'`` is not taken as true."""
    if isinstance(value, bool) or _is_numpy_bool(value):
        return bool(value)
    try:
        as_int = operator.index(value)
    except TypeError:
        as_int = None
    if as_int not in (0, 1):
        raise TypeError(f"flash_attn_ext: {name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(as_int)


def _flash_attn_keywords(dropout_p, softcap, alibi_slopes, deterministic,
                         return_attn_probs) -> tuple[float, bool, float]:
    """flash-attn's keywords: TypeError naming an argument of the wrong type (alibi_slopes: a tensor or
    None; the ops check its dtype, shape and device). Returns softcap, checked
    (``_softcap``), as a Python float, return_attn_probs as a bool (the caller then returns
    flash-attn's triple, ``_with_attn_probs``) and dropout_p as a float in [0, 1) (ValueError
    otherwise)."""
    if (type(dropout_p) is float and dropout_p == 0.0 and alibi_slopes is None and deterministic is False
            and return_attn_probs is False):
        return _softcap(softcap), False, 0.0  # the defaults, checked cheaply (eager calls pay this per layer)
    dropout = _dropout_p(dropout_p)
    softcap = _softcap(softcap)
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError("flash_attn_ext: alibi_slopes must be a float32 tensor of shape (nheads,) or (batch, nheads), "
                        f"or None; got {type(alibi_slopes).__name__} (e.g. torch.tensor(slopes, "
                        "dtype=torch.float32, device=q.device))")
    ops._fixed_alibi(alibi_slopes is not None and alibi_slopes.requires_grad and torch.is_grad_enabled())
    if deterministic is not None:  # None: flash-attn < 2.7 took it (as False); the backward is always deterministic
        _as_bool("deterministic", deterministic)
    return softcap, _as_bool("return_attn_probs", return_attn_probs), dropout


def _dropout_p(value, name: str = "dropout_p", owner: str = "flash_attn_ext") -> float:
    """An attention-dropout probability as a Python float: a real number (``_real``: TypeError for
    a bool, None, a string, a tensor that requires grad, ...) in [0, 1) (ValueError otherwise), the
    message naming ``name`` (and ``owner``: the entry that was called)."""
    try:
        p = _real(name, value)
    except TypeError as e:
        raise TypeError(str(e).replace("flash_attn_ext:", f"{owner}:", 1)) from None
    if not 0.0 <= p < 1.0:  # NaN fails
        raise ValueError(f"{owner}: {name} must be in [0, 1), got {value!r}")
    return p


def dropout_rng_state(device) -> torch.Tensor:
    """A fresh attention-dropout state for one call: (seed, offset), int64 (2,) on ``device``, drawn
    from torch's generator of that device (torch.manual_seed makes it reproducible; CUDA graphs and
    torch.compile capture the draw). The ops regenerate the mask from it (csrc/primitives/philox.cuh;
    ``reference.dropout_keep_mask`` materialises it), the backward from the forward's."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


def _dropout_args(dropout: float, q: torch.Tensor) -> tuple:
    """The ops' (dropout_p, rng_state) for a call's dropout_p (already checked)."""
    return (dropout, dropout_rng_state(q.device)) if dropout > 0.0 else (0.0, None)


def _with_attn_probs(out: torch.Tensor, softmax_lse: torch.Tensor, return_lse, return_attn_probs: bool):
    """What a dense or varlen entry returns: flash-attn's ``(out, softmax_lse, S_dmask)`` with
    return_attn_probs=True, where S_dmask (the dropout pattern, for flash-attn's tests; an empty
    tensor without dropout in flash-attn >= 2.7) is None: code ported from it gets the LSE that
    way. Else ``(out, softmax_lse)`` with return_lse, else out."""
    want_lse = _as_bool("return_lse", return_lse)
    if return_attn_probs:
        return out, softmax_lse, None
    return (out, softmax_lse) if want_lse else out


def _softcap(softcap) -> float:
    """softcap (logit soft-capping) as a Python float: a real number (``_real``: TypeError for a
    bool, None, a string, ...), finite and >= 0, 0.0 meaning none (ValueError naming softcap
    otherwise; under torch.compile the op's RuntimeError). The op checks the rest (a cap past
    float32's range: RuntimeError)."""
    if type(softcap) is float and softcap == 0.0:
        return softcap  # the default, checked cheaply
    try:
        value = _real("softcap", softcap)
    except TypeError as e:
        if softcap is None or isinstance(softcap, torch.Tensor) and softcap.dim() != 0:
            # flash-attn <= 2.5's positional order had alibi_slopes where softcap is now.
            raise TypeError(f"{e} (flash-attn >= 2.6's positional order has softcap after window_size, where a call "
                            "written for flash-attn <= 2.5 passed alibi_slopes: pass the arguments after causal by "
                            "keyword)") from None
        raise
    # Under torch.compile the op's fake kernel refuses a bad cap (a RuntimeError naming softcap):
    # a ValueError raised while tracing would reach the user as Dynamo's own error, and a symbolic
    # float (dynamic=True) cannot be formatted into a message.
    if not torch.compiler.is_compiling() and not (value >= 0.0 and value < math.inf):  # NaN fails too
        raise ValueError(f"flash_attn_ext: softcap must be a finite number >= 0 (0: no soft-capping), got {softcap!r}")
    return value


def _unpack(name: str, packed: torch.Tensor, layout: str, slots: int) -> tuple[torch.Tensor, ...]:
    """The ``slots`` views of a packed tensor (``layout``: its documented shape, the slot dimension
    named by its size): qkv -> (q, k, v), kv -> (k, v). Views, no copy; autograd stacks their
    gradients back into one packed gradient."""
    _check_tensors(**{name: packed})
    dims = layout.strip("()").split(", ")
    dim = dims.index(str(slots))
    if packed.dim() != len(dims) or packed.shape[dim] != slots:
        raise RuntimeError(f"flash_attn_ext: {name} must be {layout}, got shape {tuple(packed.shape)}")
    return packed.unbind(dim)
