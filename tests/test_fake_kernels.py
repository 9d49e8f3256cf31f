"""The fake (meta) kernels of flash_attn_ext.ops refuse what the real ops refuse
(flash_attn_ext/_fake_checks.py: the twin of csrc/flash_api.cpp's checks).

A fake kernel runs under torch.compile / FakeTensor tracing, and for every call with one tensor
argument on the meta device (the dispatcher picks the Meta kernel even when the other arguments
are CPU tensors). One that skips a check returns uninitialised memory or an impossible shape where
the op raises (and an in-place KV-cache append silently does not happen). Two checks per op, over
every tensor argument and a table of bad inputs:
  - each tensor argument alone on meta, the others on the CPU: a RuntimeError naming the device;
  - each bad input: the CPU op raises a RuntimeError, and so does the same call with every tensor
    on meta (the bad input built on meta, so that strides survive: ``.to("meta")`` of a sliced
    tensor would copy it contiguous).
"""

import pytest
import torch

import flash_attn_ext  # noqa: F401  (registers torch.ops.flash_attn_ext)

ops = torch.ops.flash_attn_ext


def _rand(dev, *shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=dev)


def _cu(dev, lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)


# ---- valid argument lists (ordered as the op's schema), built on `dev`

def _forward_args(dev):
    return dict(q=_rand(dev, 2, 16, 4, 32), k=_rand(dev, 2, 24, 2, 32), v=_rand(dev, 2, 24, 2, 32),
                softmax_scale=0.1, causal=False)


def _backward_args(dev):
    a = _forward_args(dev)
    b, sq, h, _ = a["q"].shape
    out, lse, stats = _rand(dev, *a["q"].shape), _rand(dev, b, h, sq), _rand(dev, 2, b, h, sq)
    if dev != "meta":  # the float32 CPU backward checks the statistics against its recompute
        out, lse, stats = ops.forward(a["q"], a["k"], a["v"], 0.1, False)
    return dict(dout=_rand(dev, *a["q"].shape), q=a["q"], k=a["k"], v=a["v"], out=out,
                softmax_lse=lse, softmax_scale=0.1, causal=False, softmax_stats=stats)


def _varlen_forward_args(dev):
    lens = [5, 11]
    return dict(q=_rand(dev, 16, 4, 32), k=_rand(dev, 16, 2, 32), v=_rand(dev, 16, 2, 32),
                cu_seqlens_q=_cu(dev, lens), cu_seqlens_k=_cu(dev, lens), max_seqlen_q=11, max_seqlen_k=11,
                softmax_scale=0.1, causal=False)


def _varlen_backward_args(dev):
    a = _varlen_forward_args(dev)
    out, lse, stats = _rand(dev, 16, 4, 32), _rand(dev, 4, 16), _rand(dev, 2, 4, 16)
    if dev != "meta":  # as _backward_args
        out, lse, stats = ops.varlen_forward(*a.values())
    return dict(dout=_rand(dev, 16, 4, 32), q=a["q"], k=a["k"], v=a["v"], out=out,
                softmax_lse=lse, cu_seqlens_q=a["cu_seqlens_q"], cu_seqlens_k=a["cu_seqlens_k"],
                max_seqlen_q=11, max_seqlen_k=11, softmax_scale=0.1, causal=False,
                softmax_stats=stats)


def _kvcache_args(dev, paged=False):
    cache = (5, 16, 2, 32) if paged else (2, 32, 2, 32)
    table = torch.tensor([[0, 1], [3, 4]], dtype=torch.int32, device=dev) if paged else None
    return dict(q=_rand(dev, 2, 1, 4, 32), k_cache=_rand(dev, *cache), v_cache=_rand(dev, *cache),
                k=_rand(dev, 2, 1, 2, 32), v=_rand(dev, 2, 1, 2, 32),
                cache_seqlens=torch.tensor([3, 9], dtype=torch.int32, device=dev), block_table=table,
                softmax_scale=0.1, causal=True, num_splits=0)


OPS = {
    "forward": (ops.forward, _forward_args),
    "backward": (ops.backward, _backward_args),
    "varlen_forward": (ops.varlen_forward, _varlen_forward_args),
    "varlen_backward": (ops.varlen_backward, _varlen_backward_args),
    "fwd_kvcache": (ops.fwd_kvcache, _kvcache_args),
    "fwd_kvcache_paged": (ops.fwd_kvcache, lambda dev: _kvcache_args(dev, paged=True)),
}


def _call(op_name, args):
    op, _ = OPS[op_name]
    return op(*args.values())


def test_valid_arguments_pass_on_cpu_and_meta():
    """The base argument lists are valid (so each case below fails for its own change only)."""
    for name, (_, make) in OPS.items():
        for dev in ("cpu", "meta"):
            _call(name, make(dev))


@pytest.mark.parametrize("op_name,arg", [(op_name, arg) for op_name, (_, make) in OPS.items()
                                         for arg, value in make("cpu").items()
                                         if isinstance(value, torch.Tensor)])
def test_each_tensor_alone_on_meta_is_refused(op_name, arg):
    """One tensor on meta, the rest on the CPU: the fake kernel runs and names the mismatch."""
    args = OPS[op_name][1]("cpu")
    args[arg] = args[arg].to("meta")
    with pytest.raises(RuntimeError, match=r"is on (meta|cpu) but q is on (cpu|meta)"):
        _call(op_name, args)


def _strided(t):
    """t's values in a view with a last-dim stride of 2 (on t's device)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    return wide[..., ::2]


def _set(**changes):
    """A case: args -> args with `changes` applied, each a function of the args dict."""
    def apply(a):
        for name, f in changes.items():
            a[name] = f(a)
        return a
    return apply


_OPTIONAL = ("window_size_left", "window_size_right", "sinks", "softcap", "dropout_p", "rng_state", "alibi_slopes")
_DEFAULTS = dict(window_size_left=-1, window_size_right=-1, sinks=None, softcap=0.0, dropout_p=0.0, rng_state=None,
                 alibi_slopes=None)


def _optional(**values):
    """A case: the dense / varlen ops' optional arguments (schema order, after softmax_stats for the
    backward ops) up to the last one given, the others at their defaults; each value a function of
    the args dict or a constant."""
    last = max(_OPTIONAL.index(n) for n in values)

    def apply(a):
        for name in _OPTIONAL[:last + 1]:
            value = values.get(name, _DEFAULTS[name])
            a[name] = value(a) if callable(value) else value
        return a
    return apply


def _softcap(value, kvcache=False):
    """A case: softcap (every op's last argument) set to ``value``, the optional arguments before it
    at their defaults (the args dicts are passed positionally)."""
    rest = dict(window_size_left=lambda a: -1, window_size_right=lambda a: -1, sinks=lambda a: None)
    if kvcache:
        rest["cache_leftpad"] = lambda a: None
    return _set(**rest, softcap=lambda a: value)


CASES = [
    # dense forward (the same checks run in backward: check_qkv)
    ("forward", "q last dim strided", _set(q=lambda a: _strided(a["q"]))),
    ("forward", "k float64", _set(k=lambda a: a["k"].double())),
    ("forward", "v seqlen", _set(v=lambda a: a["v"][:, :20])),
    ("forward", "headdim 12", _set(q=lambda a: a["q"][..., :12], k=lambda a: a["k"][..., :12],
                                   v=lambda a: a["v"][..., :12])),
    ("forward", "3 heads over 2", _set(q=lambda a: a["q"][:, :, :3])),
    ("forward", "batch", _set(k=lambda a: a["k"][:1], v=lambda a: a["v"][:1])),
    ("forward", "q 3-D", _set(q=lambda a: a["q"][0])),
    ("forward", "int32 inputs", _set(q=lambda a: a["q"].int(), k=lambda a: a["k"].int(), v=lambda a: a["v"].int())),
    ("forward", "scale inf", _set(softmax_scale=lambda a: float("inf"))),
    ("forward", "v heads", _set(v=lambda a: a["v"][:, :, :1])),
    ("forward", "k headdim", _set(k=lambda a: a["k"][..., :16])),
    ("forward", "no kv heads", _set(k=lambda a: a["k"][:, :, :0], v=lambda a: a["v"][:, :, :0])),
    ("forward", "window right -2", _set(window_size_left=lambda a: -1, window_size_right=lambda a: -2)),
    ("backward", "dout float64", _set(dout=lambda a: a["dout"].double())),
    ("backward", "dout 3-D", _set(dout=lambda a: a["dout"][0])),
    ("backward", "out shape", _set(out=lambda a: a["out"][:, :8])),
    ("backward", "dout shape", _set(dout=lambda a: a["dout"][:, :8])),
    ("backward", "out last dim strided", _set(out=lambda a: _strided(a["out"]))),
    ("backward", "lse float64", _set(softmax_lse=lambda a: a["softmax_lse"].double())),
    ("backward", "lse shape", _set(softmax_lse=lambda a: a["softmax_lse"][:, :, :8])),
    ("backward", "stats shape", _set(softmax_stats=lambda a: a["softmax_stats"][:1])),
    ("backward", "k last dim strided", _set(k=lambda a: _strided(a["k"]))),
    ("backward", "stats float64", _set(softmax_stats=lambda a: a["softmax_stats"].double())),
    # numbers in messages, printed as the C++ side prints a double (6 significant digits)
    ("forward", "dropout_p 1", _optional(dropout_p=1.0)),
    ("forward", "dropout_p 1/3 without rng_state", _optional(dropout_p=1 / 3)),
    ("forward", "rng_state int32", _optional(dropout_p=0.1, rng_state=lambda a: torch.zeros(
        2, dtype=torch.int32, device=a["q"].device))),
    ("forward", "scale 1e39 / 3", _set(softmax_scale=lambda a: 1e39 / 3)),
    ("forward", "softcap 1e-39 (prints softmax_scale)", _optional(softcap=1e-39)),
    ("forward", "sinks float64", _optional(sinks=lambda a: torch.zeros(4, dtype=torch.float64, device=a["q"].device))),
    ("forward", "alibi_slopes shape", _optional(alibi_slopes=lambda a: torch.ones(3, device=a["q"].device))),
    # varlen
    ("varlen_forward", "cu_seqlens_q strided", _set(cu_seqlens_q=lambda a: torch.stack(
        [a["cu_seqlens_q"], a["cu_seqlens_q"]], 1)[:, 0])),
    ("varlen_forward", "cu_seqlens_k int64", _set(cu_seqlens_k=lambda a: a["cu_seqlens_k"].long())),
    ("varlen_forward", "cu_seqlens_q 2-D", _set(cu_seqlens_q=lambda a: a["cu_seqlens_q"][None])),
    ("varlen_forward", "cu_seqlens lengths differ", _set(cu_seqlens_k=lambda a: a["cu_seqlens_k"][:2])),
    ("varlen_forward", "max_seqlen_q negative", _set(max_seqlen_q=lambda a: -1)),
    ("varlen_forward", "q 4-D", _set(q=lambda a: a["q"][None])),
    ("varlen_forward", "v rows", _set(v=lambda a: a["v"][:15])),
    ("varlen_forward", "v last dim strided", _set(v=lambda a: _strided(a["v"]))),
    ("varlen_backward", "dout float64", _set(dout=lambda a: a["dout"].double())),
    ("varlen_backward", "out 4-D", _set(out=lambda a: a["out"][None])),
    ("varlen_backward", "lse shape", _set(softmax_lse=lambda a: a["softmax_lse"][:, :8])),
    ("varlen_backward", "stats float64", _set(softmax_stats=lambda a: a["softmax_stats"].double())),
    ("varlen_backward", "stats shape", _set(softmax_stats=lambda a: a["softmax_stats"][:1])),
    ("varlen_backward", "lse float64", _set(softmax_lse=lambda a: a["softmax_lse"].double())),
    ("varlen_backward", "out strided and lse float64 (the order)", _set(
        out=lambda a: _strided(a["out"]), softmax_lse=lambda a: a["softmax_lse"].double())),
    ("varlen_backward", "sinks float64 and dout 2-D (the order)", lambda a: _optional(
        sinks=torch.zeros(4, dtype=torch.float64, device=a["q"].device))(_set(dout=lambda b: b["dout"][0])(a))),
    ("varlen_backward", "sinks shape and softcap negative (the order)", lambda a: _optional(
        sinks=torch.zeros(3, device=a["q"].device), softcap=-0.5)(a)),
    # softcap (check_softcap): negative, NaN, infinite, past float32's range
    ("forward", "softcap negative", _softcap(-1.0)),
    ("forward", "softcap 1e39", _softcap(1e39)),
    ("backward", "softcap nan", _softcap(float("nan"))),
    ("varlen_forward", "softcap inf", _softcap(float("inf"))),
    ("varlen_backward", "softcap negative", _softcap(-0.5)),
    ("fwd_kvcache", "softcap negative", _softcap(-2.0, kvcache=True)),
    ("fwd_kvcache_paged", "softcap below float32's normal range", _softcap(1e-39, kvcache=True)),
    # KV cache
    ("fwd_kvcache", "k float64", _set(k=lambda a: a["k"].double(), v=lambda a: a["v"].double())),
    ("fwd_kvcache", "k last dim strided", _set(k=lambda a: _strided(a["k"]))),
    ("fwd_kvcache", "k_cache last dim strided", _set(k_cache=lambda a: _strided(a["k_cache"]))),
    ("fwd_kvcache", "expanded cache with an append", _set(k_cache=lambda a: a["k_cache"][:1].expand(2, -1, -1, -1),
                                                          v_cache=lambda a: a["v_cache"][:1].expand(2, -1, -1, -1))),
    ("fwd_kvcache", "k without v", _set(v=lambda a: None)),
    ("fwd_kvcache", "k and v seqlen_new differ", _set(v=lambda a: torch.cat([a["v"], a["v"]], 1))),
    ("fwd_kvcache", "append without cache_seqlens", _set(cache_seqlens=lambda a: None)),
    ("fwd_kvcache", "cache_seqlens int64", _set(cache_seqlens=lambda a: a["cache_seqlens"].long())),
    ("fwd_kvcache", "cache_seqlens strided", _set(cache_seqlens=lambda a: torch.stack(
        [a["cache_seqlens"], a["cache_seqlens"]], 1)[:, 0])),
    ("fwd_kvcache", "cache_seqlens shape", _set(cache_seqlens=lambda a: a["cache_seqlens"][:1])),
    ("fwd_kvcache", "cache batch", _set(k_cache=lambda a: a["k_cache"][:1], v_cache=lambda a: a["v_cache"][:1])),
    ("fwd_kvcache", "v_cache shape", _set(v_cache=lambda a: a["v_cache"][:, :16])),
    ("fwd_kvcache", "num_splits 500", _set(num_splits=lambda a: 500)),
    ("fwd_kvcache", "q float64", _set(q=lambda a: a["q"].double())),
    ("fwd_kvcache_paged", "block_table int64", _set(block_table=lambda a: a["block_table"].long())),
    ("fwd_kvcache_paged", "block_table strided", _set(block_table=lambda a: torch.stack(
        [a["block_table"], a["block_table"]], 2)[..., 0])),
    ("fwd_kvcache_paged", "block_table shape", _set(block_table=lambda a: a["block_table"][:1])),
    ("fwd_kvcache_paged", "page size 8", _set(k_cache=lambda a: a["k_cache"][:, :8], v_cache=lambda a: a["v_cache"][:, :8])),
]


@pytest.mark.parametrize("op_name,what,change", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_bad_input_refused_by_op_and_fake(op_name, what, change):
    """The op (CPU) and its fake kernel (meta) refuse the input by the same check with the same
    message, word for word (dtypes as torch spells them, numbers as the C++ side prints a double,
    the checks in the same order: a check missing from one side, or run after another, shows even
    where a later check would refuse the input too). The messages up to torch's appended C++
    context (the op's own line: "flash_attn_ext: ...")."""
    messages = []
    for dev in ("cpu", "meta"):
        args = change(OPS[op_name][1](dev))
        with pytest.raises((RuntimeError, ValueError, NotImplementedError), match="^flash_attn_ext: ") as err:
            _call(op_name, args)
        messages.append((type(err.value).__name__, str(err.value).splitlines()[0]))
    assert messages[0] == messages[1], messages


@pytest.mark.parametrize("op_name", ["forward", "fwd_kvcache"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_softmax_scale_at_float32s_edge_taken_by_op_and_fake(op_name, sign):
    """softmax_scale whose product with log2(e) is past float32's max as a double but rounds to it
    in float32 (below FLT_MAX + 2^103) is taken by the op and by its fake kernel alike (the fake
    refused |scale| in [2.3586574916681825e38, 2.358657561961658e38)); past that, both refuse."""
    taken = sign * 2.3586575619e38
    refused = sign * 2.3586575620e38
    for dev in ("cpu", "meta"):
        args = OPS[op_name][1](dev)
        args["softmax_scale"] = taken
        _call(op_name, args)
        args = OPS[op_name][1](dev)
        args["softmax_scale"] = refused
        with pytest.raises(RuntimeError, match=r"softmax_scale must be finite .* got -?2\.35866e\+38"):
            _call(op_name, args)


MAX_SEQLEN = 2**31 - 256


@pytest.mark.parametrize("op_name,args,match", [
    ("forward", dict(q=(1, MAX_SEQLEN + 1, 1, 8), k=(1, 16, 1, 8), v=(1, 16, 1, 8)), "seqlen_k be at most 2"),
    ("varlen_forward", dict(q=(MAX_SEQLEN + 1, 1, 8), k=(16, 1, 8), v=(16, 1, 8)), "total_q and total_k must be at most"),
    ("fwd_kvcache", dict(q=(1, 2**30, 4, 8), k_cache=(1, 16, 1, 8), v_cache=(1, 16, 1, 8)), "packed rows of a kv head"),
    ("fwd_kvcache_paged", dict(block_table=(2, 2**27)), r"block_table.size\(1\) \* page_size"),
], ids=["forward seqlen", "varlen total_q", "kvcache packed rows", "paged cache length"])
def test_size_limits_refused_on_meta(op_name, args, match):
    """The int32 size limits, on meta tensors (free at any size; test_bad_input.py has the CPU
    op's side with expanded tensors)."""
    a = OPS[op_name][1]("meta")
    for name, shape in args.items():
        a[name] = torch.empty(shape, dtype=a[name].dtype, device="meta")
    with pytest.raises(RuntimeError, match=match):
        _call(op_name, a)


@pytest.mark.parametrize("sliced", ["dense k / v", "kvcache q", "kvcache k / v"])
def test_sizes_of_data_dependent_length_compile(sliced):
    """Keys or queries counted by .item() (unbacked sizes under torch.compile; no torch._check hints
    given) compile with fullgraph=True on two input shapes: the shape checks that compare sizes (k's
    and v's seqlen, the int32 bounds) are runtime asserts there, not guards ("Could not guard on
    data-dependent expression Ne(u2, u1)" before). The eager bits."""
    def step(q, k, v, n):
        m = n.item()
        if sliced == "dense k / v":
            return flash_attn_ext.flash_attn_func(q, k[:, :m], v[:, :m], causal=True)
        if sliced == "kvcache k / v":
            kc, vc = torch.zeros(q.shape[0], 32, 2, 16), torch.zeros(q.shape[0], 32, 2, 16)
            return flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, k[:, :m], v[:, :m], causal=True,
                                                          cache_seqlens=torch.full((q.shape[0],), 4, dtype=torch.int32))
        torch._check(m >= 0)
        torch._check(m <= q.shape[1])
        return flash_attn_ext.flash_attn_with_kvcache(q[:, :m], k, v, causal=True,
                                                      cache_seqlens=torch.full((q.shape[0],), k.shape[1],
                                                                               dtype=torch.int32))

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True), torch.no_grad():
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        for b, s in ((5, 6), (7, 9)):
            q, k, v = torch.randn(b, s, 4, 16), torch.randn(b, s + 2, 2, 16), torch.randn(b, s + 2, 2, 16)
            assert torch.equal(compiled(q, k, v, torch.tensor(3)), step(q, k, v, torch.tensor(3)))
