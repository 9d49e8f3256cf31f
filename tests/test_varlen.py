"""flash_attn_varlen_func on the CPU (the CUDA kernels: tests/test_varlen_cuda.py): each packed
sequence gives what the dense op gives on it alone, forward and backward, within the accuracy rule
(tests/accuracy.py) against the float64 reference; zero-length sequences; bad input; the op
surface (opcheck, torch.compile fullgraph)."""

import math

import numpy as np
import pytest
import torch

import flash_attn_ext
from accuracy import check_accuracy
from conftest import check_fwd_bwd
from flash_attn_ext.reference import attention_varlen_ref

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cu_seqlens(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


def make_varlen(lens_q, lens_k, nheads, nheads_k, headdim, dtype, requires_grad=True):
    tq, tk = sum(lens_q), sum(lens_k)

    def rnd(*shape):
        return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)

    return (rnd(tq, nheads, headdim), rnd(tk, nheads_k, headdim), rnd(tk, nheads_k, headdim),
            cu_seqlens(lens_q), cu_seqlens(lens_k))


def check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale=None):
    return check_fwd_bwd(
        q, k, v,
        lambda: flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale,
                                                      causal=causal, return_lse=True),
        lambda upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, softmax_scale, causal, upcast=upcast))


LENGTHS = [
    ([5, 17, 64, 1], [5, 17, 64, 1]),          # self-attention, mixed lengths
    ([3, 40, 9], [70, 12, 9]),                 # seqlen_q != seqlen_k per sequence (both ways)
    ([0, 8, 0, 33], [4, 0, 0, 33]),            # zero-length q and/or k sequences
    ([130], [65]),                             # one sequence, several tiles
]


@pytest.mark.parametrize("lens_q,lens_k", LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nheads,nheads_k", [(4, 4), (4, 2)])
def test_varlen_matches_per_sequence_reference(lens_q, lens_k, causal, dtype, nheads, nheads_k, poison_empty):
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, nheads, nheads_k, 32, dtype)
    check_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal)


def test_varlen_equals_dense_op_per_sequence():
    """The CPU twin runs each sequence through the dense kernel: bitwise equal to flash_attn_func."""
    lens = [7, 30, 1, 64]
    q, k, v, cu_q, cu_k = make_varlen(lens, lens, 2, 1, 16, torch.float32, requires_grad=False)
    out, lse = flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 64, causal=True, return_lse=True)
    for b in range(len(lens)):
        s, e = int(cu_q[b]), int(cu_q[b + 1])
        o_b, lse_b = flash_attn_ext.flash_attn_func(q[s:e][None], k[s:e][None], v[s:e][None], causal=True,
                                                    return_lse=True)
        assert torch.equal(out[s:e], o_b[0]) and torch.equal(lse[:, s:e], lse_b[0])


def test_varlen_larger_max_seqlen_and_uncovered_rows():
    """max_seqlen above every length is fine; rows after cu_seqlens[-1] get out 0, lse +inf (CPU)."""
    q, k, v, _, _ = make_varlen([10], [10], 2, 2, 16, torch.float32, requires_grad=False)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    out, lse = flash_attn_ext.flash_attn_varlen_func(q, k, v, cu, cu, 100, 100, return_lse=True)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu, cu)
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[8:], torch.zeros_like(out[8:])) and torch.isinf(lse[:, 8:]).all()


def test_varlen_max_seqlen_zero_and_empty_batch():
    q, k, v, _, _ = make_varlen([6], [6], 2, 2, 16, torch.float32)
    zeros = torch.zeros(2, dtype=torch.int32)
    out, lse = flash_attn_ext.flash_attn_varlen_func(q[:0], k[:0], v[:0], zeros, zeros, 0, 0, return_lse=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    empty = torch.zeros(1, dtype=torch.int32)  # batch 0
    out = flash_attn_ext.flash_attn_varlen_func(q, k, v, empty, empty, 0, 0)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def _args():
    q, k, v, cu_q, cu_k = make_varlen([3, 5], [3, 5], 2, 2, 16, torch.float32, requires_grad=False)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=5)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), "cu_seqlens_q has dtype"),
    (lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"][:2]), "cu_seqlens_q has 3 entries but cu_seqlens_k has 2"),
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][None]), "cu_seqlens_q has shape"),
    (lambda a: a.update(cu_seqlens_q=torch.tensor([0, 4, 3], dtype=torch.int32)), "non-decreasing"),
    (lambda a: a.update(cu_seqlens_q=torch.tensor([1, 5, 8], dtype=torch.int32)), r"cu_seqlens_q\[0\] = 1; expected 0"),
    (lambda a: a.update(cu_seqlens_k=torch.tensor([0, 3, 9], dtype=torch.int32)), r"cu_seqlens_k\[2\] = 9 is outside"),
    (lambda a: a.update(max_seqlen_q=4), "max_seqlen_q = 4"),
    (lambda a: a.update(max_seqlen_k=-1), "max_seqlen_q and max_seqlen_k must be in"),
    # past int64 (the op's argument): the same message, by the user function before the op
    (lambda a: a.update(max_seqlen_q=2**70),
     r"max_seqlen_q and max_seqlen_k must be in .* got 1180591620717411303424 and 5"),
    (lambda a: a.update(q=a["q"][None]), "q must be 3-D"),
    (lambda a: a.update(v=a["v"][:4]), "v has 4 rows but k has total_k = 8"),
    (lambda a: a.update(k=a["k"].double()), "k has dtype"),
])
def test_varlen_bad_input(change, match):
    args = _args()
    change(args)
    with pytest.raises(RuntimeError, match=match):
        flash_attn_ext.flash_attn_varlen_func(**args)


def test_varlen_opcheck():
    q, k, v, cu_q, cu_k = make_varlen([3, 0, 9], [4, 2, 9], 4, 2, 16, torch.float32)
    torch.library.opcheck(torch.ops.flash_attn_ext.varlen_forward.default, (q, k, v, cu_q, cu_k, 9, 9, 0.25, True))
    out, lse, stats = torch.ops.flash_attn_ext.varlen_forward(q, k, v, cu_q, cu_k, 9, 9, 0.25, True)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.flash_attn_ext.varlen_backward.default,
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, cu_q, cu_k, 9, 9, 0.25, True,
                           stats))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_varlen_torch_compile_fullgraph(backend):
    """fwd + bwd compiles without a graph break (fake kernels need no cu_seqlens values); same results."""
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = make_varlen([5, 11, 2], [7, 11, 3], 4, 2, 16, torch.float32)

    def step(q, k, v):
        return flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 11, 11, causal=True).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_loss = step(q, k, v)
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    torch.testing.assert_close(loss, ref_loss)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg)


@pytest.mark.parametrize("device,dtype", [
    ("cpu", torch.float32),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_varlen_max_seqlen_stays_symbolic_under_compile(device, dtype):
    """max_seqlen_q / max_seqlen_k are SymInt in the ops' schemas and the Python checks leave them
    symbolic: packed batches whose longest sequence changes every step compile once more after the
    first (torch's automatic dynamic), not once per value (past the recompile limit, fullgraph=True
    raised), fwd + bwd with a sliding window and ALiBi too; a value read from a tensor (.item(), as
    transformers' _get_unpad_data does) compiles with fullgraph=True. The eager results, bit for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    slopes = torch.rand(2, device=device)

    def case(lengths, requires_grad=True):
        q, k, v, cu, _ = make_varlen(lengths, lengths, 2, 1, 16, dtype, requires_grad=False)
        return (*(t.to(device).requires_grad_(requires_grad) for t in (q, k, v)), cu.to(device))

    def step(q, k, v, cu, m, window, alibi):
        return flash_attn_ext.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True, window_size=window,
                                                     alibi_slopes=alibi)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for i, split in enumerate(range(20, 32)):  # 12 values of max_seqlen, past the recompile limit of 8
        lengths = [split, 64 - split]
        window, alibi = [((-1, -1), None), ((9, 0), None), ((-1, -1), slopes)][i % 3]
        q, k, v, cu = case(lengths)
        args = (cu, max(lengths), window, alibi)
        out = compiled(q, k, v, *args)
        ref = step(q, k, v, *args)
        assert torch.equal(out, ref)
        for g, rg in zip(torch.autograd.grad(out.square().sum(), (q, k, v)),
                         torch.autograd.grad(ref.square().sum(), (q, k, v))):
            assert torch.equal(g, rg)
    assert counter.frame_count <= 4, counter.frame_count  # a graph per (window, alibi) kind, not per value

    def unpadded(q, k, v, seqlens):  # transformers' _get_unpad_data
        cu = torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
        m = int(seqlens.max().item())
        return flash_attn_ext.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True, window_size=(3, 0))

    q, k, v, _ = case([4, 6], requires_grad=False)
    seqlens = torch.tensor([4, 6], dtype=torch.int32, device=device)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        out = torch.compile(unpadded, fullgraph=True, backend="aot_eager")(q, k, v, seqlens)
    assert torch.equal(out, unpadded(q, k, v, seqlens))


def test_varlen_cu_seqlens_of_data_dependent_length_compiles():
    """cu_seqlens whose length comes from the data (sequence starts found by .nonzero() in restarting
    position ids, as transformers' packed-sequence path finds them) compile with fullgraph=True and
    dynamic=True, forward and backward: the batch's int32 bound on an unbacked size is a runtime
    assert, not a guard (a plain comparison raised GuardOnDataDependentSymNode). The eager bits."""
    def step(q, k, v, pos):
        starts = torch.cat([pos.new_ones(1, dtype=torch.bool), pos.diff() <= 0]).nonzero().flatten()
        cu = torch.cat([starts, starts.new_full((1,), pos.shape[0])]).int()
        return flash_attn_ext.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, causal=True)

    pos = torch.tensor([0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4])
    q, k, v = (torch.randn(12, 4, 16, requires_grad=True) for _ in range(3))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        out = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")(q, k, v, pos)
    ref = step(q, k, v, pos)
    assert torch.equal(out, ref)
    for g, rg in zip(torch.autograd.grad(out.square().sum(), (q, k, v)),
                     torch.autograd.grad(ref.square().sum(), (q, k, v))):
        assert torch.equal(g, rg)


def test_varlen_unpad_pattern_compiles_for_every_batch_shape():
    """flash-attn's / transformers' padding path (token indices = mask.flatten().nonzero(), packed
    rows gathered by them, max_seqlen by .item(), the output scattered back) under
    torch.compile(fullgraph=True), batches of three shapes: total_q / total_k are unbacked sizes,
    whose int32 bound was a plain comparison (the automatic-dynamic recompile of the second shape
    raised "Could not guard on data-dependent expression"). Forward and backward, the eager bits."""
    import torch.nn.functional as F
    heads, d = 4, 16

    def attn(q, k, v, mask):
        b, length = mask.shape
        idx = mask.flatten().nonzero().flatten()
        seqlens = mask.sum(1, dtype=torch.int32)
        cu = F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
        m = int(seqlens.max().item())
        o = flash_attn_ext.flash_attn_varlen_func(q.flatten(0, 1)[idx], k.flatten(0, 1)[idx], v.flatten(0, 1)[idx],
                                                  cu, cu, m, m, causal=True)
        return torch.zeros(b * length, heads, d).index_put((idx,), o).view(b, length, heads, d)

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
        for b, length in ((3, 10), (3, 14), (5, 9)):
            q, k, v = (torch.randn(b, length, heads, d, generator=gen, requires_grad=True) for _ in range(3))
            mask = torch.arange(length)[None] < torch.randint(1, length + 1, (b,), generator=gen)[:, None]
            out, ref = compiled(q, k, v, mask), attn(q, k, v, mask)
            assert torch.equal(out, ref)
            for g, rg in zip(torch.autograd.grad(out.square().sum(), (q, k, v)),
                             torch.autograd.grad(ref.square().sum(), (q, k, v))):
                assert torch.equal(g, rg)


def test_compiled_checks_keep_their_messages():
    """Under torch.compile a refused call still names the cause: the checks of a fake kernel run in
    plain Python when Dynamo calls the op on fake tensors (a second engineer's review found that a
    message-less torch._check there, taken on torch 2.13 where is_compiling() holds inside fake
    kernels, turned every refusal into torch's 'Expected cond to be True'), with a static max_seqlen
    and after it went symbolic."""
    q = torch.randn(2, 8, 2, 16)
    torch._dynamo.reset()
    with pytest.raises(NotImplementedError, match="dropout_p > 0 with a sliding window's left bound"):
        torch.compile(lambda q: flash_attn_ext.flash_attn_func(q, q, q, dropout_p=0.1, window_size=(2, 0)),
                      backend="eager")(q)
    with pytest.raises(NotImplementedError, match="alibi_slopes with a sliding window's left bound"):
        torch.compile(lambda q: flash_attn_ext.flash_attn_func(q, q, q, alibi_slopes=torch.rand(2),
                                                               window_size=(2, 0)), backend="eager")(q)
    qv, cu = torch.randn(12, 2, 16), torch.tensor([0, 5, 12], dtype=torch.int32)
    torch._dynamo.reset()
    f = torch.compile(lambda q, cu, m: flash_attn_ext.flash_attn_varlen_func(q, q, q, cu, cu, m, 7),
                      backend="eager", fullgraph=True)
    for m in (7, 8):  # the second value makes max_seqlen_q symbolic
        f(qv, cu, m)
    with pytest.raises(Exception, match="max_seqlen_q and max_seqlen_k must be in"):
        f(qv, cu, -1)
    torch._dynamo.reset()  # with fullgraph=True Dynamo reports a fake kernel's NotImplementedError as
    with pytest.raises(Exception, match="dropout_p > 0 with a sliding window's left bound"):  # Unsupported
        torch.compile(lambda q: flash_attn_ext.flash_attn_func(q, q, q, dropout_p=0.1, window_size=(2, 0)),
                      backend="eager", fullgraph=True)(q)


def test_paged_varlen_max_seqlen_stays_symbolic_under_compile():
    """Paged varlen (block_table) with max_seqlen changing every call compiles under fullgraph=True
    without a graph per value (its in-graph value checks format no symbolic size), the eager bits."""
    from torch._dynamo.testing import CompileCounterWithBackend
    k_cache, v_cache = torch.randn(40, 16, 2, 16), torch.randn(40, 16, 2, 16)
    table = torch.arange(9, dtype=torch.int32).reshape(3, 3)

    def call(q, cu_q, cu_k, max_q, max_k):
        return flash_attn_ext.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, causal=True,
                                                     block_table=table)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(call, fullgraph=True, backend=counter)
    for a in range(3, 12):  # 9 values
        lens_q, lens_k = [a, 12 - a, 5], [a + 10, 20, 7]
        cu_q = torch.tensor([0] + np.cumsum(lens_q).tolist(), dtype=torch.int32)
        cu_k = torch.tensor([0] + np.cumsum(lens_k).tolist(), dtype=torch.int32)
        q = torch.randn(sum(lens_q), 4, 16)
        assert torch.equal(compiled(q, cu_q, cu_k, max(lens_q), max(lens_k)),
                           call(q, cu_q, cu_k, max(lens_q), max(lens_k)))
    assert counter.frame_count <= 3, counter.frame_count
    # The KV-cache op it calls takes no max_seqlen: the range is checked on this path itself (a
    # second engineer's case: 2^31 - 255 ran under compile where the eager call refused it).
    with pytest.raises(Exception, match="2147483392"):  # torch's message names the bound it checked
        compiled(q, cu_q, cu_k, max(lens_q), 2**31 - 255)
    with pytest.raises(RuntimeError, match="max_seqlen_q and max_seqlen_k must be in"):
        call(q, cu_q, cu_k, max(lens_q), 2**31 - 255)


def test_varlen_arguments_are_ints_and_fake_checks_max_seqlen():
    args = _args()
    args["max_seqlen_q"] = 5.9
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        flash_attn_ext.flash_attn_varlen_func(**args)
    args = {n: (t.to("meta") if isinstance(t, torch.Tensor) else t) for n, t in _args().items()}
    args["max_seqlen_q"] = -1
    with pytest.raises(RuntimeError, match="max_seqlen_q and max_seqlen_k must be in"):
        flash_attn_ext.flash_attn_varlen_func(**args)
    with pytest.raises(RuntimeError, match="max_seqlen_q and max_seqlen_k must be in"):  # the op's fake checks
        torch.ops.flash_attn_ext.varlen_forward(*args.values(), 0.25, False)


def test_varlen_transforms_give_clear_errors():
    q, k, v, cu_q, cu_k = make_varlen([3, 5], [3, 5], 2, 2, 16, torch.float32, requires_grad=False)

    def loss(q):
        return flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5).sum()

    with pytest.raises(NotImplementedError, match="flash_attn_varlen_func .* not supported"):
        torch.func.grad(loss)(q)
    with pytest.raises(NotImplementedError, match="flash_attn_varlen_func .* not supported"):
        torch.func.jvp(lambda q: flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5), (q,), (q,))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("extra", [{}, {"softcap": 2.0}, {"window_size": (2, 0)}, {"sinks": True}])
def test_varlen_forward_ad(causal, extra):
    """Forward mode through torch.autograd.forward_ad dual tensors (each sequence's jvp,
    ops.attention_jvp): the tangent of out equals the float64 reference's (plain torch ops) to
    rounding, zero-length q and k sequences included; with sinks their tangent too (the sinks and
    their tangent rounded to float32 first, as the interface casts them)."""
    import torch.autograd.forward_ad as fwAD
    q, k, v, cu_q, cu_k = make_varlen([3, 0, 7, 5], [4, 6, 0, 9], 4, 2, 16, torch.float64, requires_grad=False)
    sinks = torch.randn(4, dtype=torch.float64).float().double() if extra.get("sinks") else None
    kw = {key: val for key, val in extra.items() if key != "sinks"}
    tangents = [torch.randn_like(t) for t in (q, k, v)]
    with fwAD.dual_level():
        duals = [fwAD.make_dual(t, dt) for t, dt in zip((q, k, v), tangents)]
        dsinks = None if sinks is None else fwAD.make_dual(sinks, torch.randn_like(sinks).float().double())
        out = flash_attn_ext.flash_attn_varlen_func(*duals, cu_q, cu_k, 7, 9, causal=causal, sinks=dsinks, **kw)
        ref = attention_varlen_ref(*duals, cu_q, cu_k, causal=causal, sinks=dsinks, **kw)[0]
        out_t, ref_t = fwAD.unpack_dual(out).tangent, fwAD.unpack_dual(ref).tangent
    torch.testing.assert_close(out_t, ref_t, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, 1, np.True_, "no", 0.5, None])
def test_varlen_causal_must_be_a_bool(causal):
    """causal='no' used to run causal (bool('no') is True): only bools (numpy's too) and 0 / 1 are
    taken."""
    args = _args()
    if causal in (True, 1):  # np.True_ == True: taken, and run as causal=True
        out = flash_attn_ext.flash_attn_varlen_func(**args, causal=causal)
        assert torch.equal(out, flash_attn_ext.flash_attn_varlen_func(**args, causal=True))
        assert not torch.equal(out, flash_attn_ext.flash_attn_varlen_func(**args, causal=False))
        return
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attn_ext.flash_attn_varlen_func(**args, causal=causal)


# ---- paged K / V (block_table): flash-attn's paged varlen, inference -----------------------------

def _paged_case(lens_q, lens_k, nheads, nheads_k, d, dtype, page_size, device):
    """A paged varlen call's inputs: packed q; k / v caches of shuffled pages holding each
    sequence's keys in its block_table's pages, every other cache row NaN (never read); and the
    same keys packed (total_k rows) for the reference."""
    batch, max_blocks = len(lens_q), max(1, math.ceil(max(lens_k) / page_size))
    num_blocks = batch * max_blocks + 2
    kc = torch.full((num_blocks, page_size, nheads_k, d), math.nan, dtype=dtype)
    vc = torch.full_like(kc, math.nan)
    table = torch.randperm(num_blocks)[:batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    k = torch.randn(int(cu_k[-1]), nheads_k, d, dtype=dtype)
    v = torch.randn_like(k)
    for b, n in enumerate(lens_k):
        rows = torch.arange(n)
        blocks = table[b, rows // page_size].long()
        kc[blocks, rows % page_size] = k[int(cu_k[b]):int(cu_k[b]) + n]
        vc[blocks, rows % page_size] = v[int(cu_k[b]):int(cu_k[b]) + n]
    q = torch.randn(int(cu_q[-1]), nheads, d, dtype=dtype)
    return [t.to(device) for t in (q, kc, vc, table, k, v, cu_q, cu_k)]


PAGED_DEVICES = [pytest.param("cpu", torch.float32, id="cpu-fp32"), pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
                 pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=requires_cuda),
                 pytest.param("cuda", torch.float16, id="cuda-fp16", marks=requires_cuda)]


@pytest.mark.parametrize("device,dtype", PAGED_DEVICES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (6, 0)])
@pytest.mark.parametrize("page_size,extras", [(16, {}), (32, {"softcap": 5.0}), (16, {"sinks": True}),
                                               (16, {"alibi": True})])
def test_paged_varlen_matches_each_sequence(device, dtype, causal, window, page_size, extras, poison_empty):
    """flash_attn_varlen_func with block_table (flash-attn's paged varlen: chunked prefill against
    a serving engine's cache): each sequence's out and LSE within the accuracy rule of the float64
    reference on its keys alone (bottom-right causal / window per sequence, GQA, zero-length q and
    k sequences, softcap, sinks, ALiBi (per-sequence slopes)); the cache rows past each sequence's
    keys are NaN and never reach the output; return_attn_probs gives flash-attn's triple."""
    if extras.get("alibi") and window[0] >= 0:
        pytest.skip("ALiBi has no sliding-window twin (refused: tests/test_alibi.py)")
    lens_q, lens_k = [3, 0, 9, 1, 17, 4], [10, 5, 9, 0, 70, 2]
    q, kc, vc, table, k, v, cu_q, cu_k = _paged_case(lens_q, lens_k, 4, 2, 64, dtype, page_size, device)
    kw = dict(causal=causal, window_size=window, softcap=extras.get("softcap", 0.0),
              sinks=torch.randn(4, device=device) if extras.get("sinks") else None)
    if extras.get("alibi"):
        kw["alibi_slopes"] = torch.rand(len(lens_q), 4, device=device)
    out, lse, s_dmask = flash_attn_ext.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k),
                                                              block_table=table, return_attn_probs=True, **kw)
    assert s_dmask is None
    ref = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, window_size=window, sinks=kw["sinks"],
                               softcap=kw["softcap"], alibi_slopes=kw.get("alibi_slopes"))
    base = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, window_size=window, sinks=kw["sinks"],
                                softcap=kw["softcap"], upcast=False, alibi_slopes=kw.get("alibi_slopes"))
    check_accuracy("paged varlen out", out, ref[0], base[0])
    check_accuracy("paged varlen lse", lse, ref[1], base[1])


def test_paged_varlen_uncovered_rows_and_empty_batch():
    """q rows past cu_seqlens_q[-1] get out 0 and LSE +inf (the reference's convention), without
    disturbing the covered rows; a batch of 0 sequences gives zeros / +inf."""
    q, kc, vc, table, k, v, cu_q, cu_k = _paged_case([5, 2], [9, 20], 2, 1, 32, torch.float64, 16, "cpu")
    q_more = torch.cat([q, torch.randn(3, 2, 32, dtype=torch.float64)])
    out, lse = flash_attn_ext.flash_attn_varlen_func(q_more, kc, vc, cu_q, cu_k, 5, 20, causal=True,
                                                     block_table=table, return_lse=True)
    ref_out, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    torch.testing.assert_close(out[:7], ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse[:, :7], ref_lse, rtol=0, atol=1e-12)
    assert torch.equal(out[7:], torch.zeros_like(out[7:])) and torch.isinf(lse[:, 7:]).all()
    empty = torch.zeros(1, dtype=torch.int32)
    out, lse = flash_attn_ext.flash_attn_varlen_func(q, kc, vc, empty, empty, 0, 0, block_table=table[:0],
                                                     return_lse=True)
    assert torch.equal(out, torch.zeros_like(q)) and torch.isinf(lse).all() and lse.shape == (2, 7)
    zero_q = torch.zeros(3, dtype=torch.int32)                                    # max_seqlen_q = 0
    out, lse = flash_attn_ext.flash_attn_varlen_func(q, kc, vc, zero_q, cu_k, 0, 20, block_table=table,
                                                     return_lse=True)
    assert torch.equal(out, torch.zeros_like(q)) and torch.isinf(lse).all()


def test_paged_varlen_refusals():
    """Paged varlen is inference only (as flash-attn's): a grad-enabled call with an input that
    requires grad raises, naming the way out; k / v that are not paged caches, a block_table of
    another batch, cu_seqlens that decrease: RuntimeErrors naming them, before any work."""
    q, kc, vc, table, k, v, cu_q, cu_k = _paged_case([5, 2], [9, 20], 2, 1, 32, torch.float32, 16, "cpu")
    call = flash_attn_ext.flash_attn_varlen_func
    with pytest.raises(RuntimeError, match="inference only: no gradient.*torch.no_grad"):
        call(q.requires_grad_(), kc, vc, cu_q, cu_k, 5, 20, block_table=table)
    with torch.no_grad():
        out = call(q, kc, vc, cu_q, cu_k, 5, 20, block_table=table)
    assert not out.requires_grad
    q = q.detach()
    with pytest.raises(RuntimeError, match=r"with block_table, k must be a paged cache \(num_blocks, page_size"):
        call(q, k, v, cu_q, cu_k, 5, 20, block_table=table)
    with pytest.raises(RuntimeError, match=r"block_table shape \(1, 2\); expected .*\(2, max_blocks\)"):
        call(q, kc, vc, cu_q, cu_k, 5, 20, block_table=table[:1])
    with pytest.raises(RuntimeError, match="cu_seqlens_k must start at 0 and not decrease"):
        call(q, kc, vc, cu_q, torch.tensor([0, 9, 5], dtype=torch.int32), 5, 20, block_table=table)
    with pytest.raises(RuntimeError, match="at most max_seqlen_k = 19 keys"):           # 20 keys
        call(q, kc, vc, cu_q, cu_k, 5, 19, block_table=table)
    with pytest.raises(RuntimeError, match="keys that fit their block_table's 2 pages of 16 rows"):
        call(q, kc, vc, cu_q, torch.tensor([0, 33, 40], dtype=torch.int32), 5, 40, block_table=table)
    with pytest.raises(RuntimeError, match="at most max_seqlen_q = 4 queries"):
        call(q, kc, vc, cu_q, cu_k, 4, 20, block_table=table)
    with pytest.raises(RuntimeError, match="block_table has dtype torch.int64; expected int32$"):
        call(q, kc, vc, cu_q, cu_k, 5, 20, block_table=table.long())
    kc8, vc8 = (c.reshape(-1, 8, *c.shape[2:]) for c in (kc, vc))   # pages of 8 rows: the message names them alone
    with pytest.raises(RuntimeError, match=r"^flash_attn_ext: paged k has page_size 8 \(k.size\(1\)\); expected a "
                                           "positive multiple of 16$"):
        call(q, kc8, vc8, cu_q, cu_k, 5, 20, block_table=table)
    with pytest.raises(RuntimeError, match="with block_table, headdim must be a multiple of 8 .* got 12"):
        call(q[..., :12], kc[..., :12], vc[..., :12], cu_q, cu_k, 5, 20, block_table=table)
    with pytest.raises(RuntimeError, match="with block_table, k must have a contiguous last dimension"):
        call(q, torch.cat([kc, kc], dim=-1)[..., ::2], vc, cu_q, cu_k, 5, 20, block_table=table)
    with pytest.raises(RuntimeError, match="v has dtype torch.float64"):
        call(q, kc, vc.double(), cu_q, cu_k, 5, 20, block_table=table)
    with pytest.raises(RuntimeError, match=r"with block_table, q has shape .* expected k and v of one paged layout"):
        call(q, kc, vc[:, :, :, :16], cu_q, cu_k, 5, 20, block_table=table)     # named k / v, not k_cache / v_cache
    with pytest.raises(RuntimeError, match="inference only.*and sinks"):
        call(q, kc, vc, cu_q, cu_k, 5, 20, block_table=table, sinks=torch.zeros(2, requires_grad=True))
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="inference only.*forward-mode dual"):
        call(fwAD.make_dual(q, torch.randn_like(q)), kc, vc, cu_q, cu_k, 5, 20, block_table=table)
    # Under torch.compile the same value checks run in the graph (an in-graph assert on the CPU).
    f = torch.compile(lambda cu: call(q, kc, vc, cu, cu_k, 5, 20, block_table=table), fullgraph=True,
                      backend="aot_eager")
    with pytest.raises(RuntimeError, match="cu_seqlens_q must start at 0"):
        f(torch.tensor([0, 6, 7], dtype=torch.int32))


def test_paged_varlen_compiles_fullgraph():
    """torch.compile(fullgraph=True) of a paged varlen call: no graph break (the gather / scatter
    indices are tensor ops on cu_seqlens, no host sync), the eager bits."""
    q, kc, vc, table, k, v, cu_q, cu_k = _paged_case([5, 2, 7], [9, 20, 3], 2, 1, 32, torch.float32, 16, "cpu")

    def f(q, kc, vc, cu_q, cu_k, table):
        return flash_attn_ext.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 7, 20, causal=True, block_table=table)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(q, kc, vc, cu_q, cu_k, table),
                       f(q, kc, vc, cu_q, cu_k, table))
    # Fake tensors outside Dynamo (make_fx) carry no values: the host checks step aside.
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(f, tracing_mode="fake")(q, kc, vc, cu_q, cu_k, table)
    assert torch.equal(gm(q, kc, vc, cu_q, cu_k, table), f(q, kc, vc, cu_q, cu_k, table))


@requires_cuda
def test_paged_varlen_and_padding_do_not_sync():
    """No host sync on CUDA in the Python around the kernels (the paged varlen's gathers, the head
    dims padded): torch.cuda.set_sync_debug_mode("error") raises on any."""
    q, kc, vc, table, k, v, cu_q, cu_k = _paged_case([5, 2, 7], [9, 20, 3], 4, 2, 64, torch.bfloat16, 16, "cuda")
    qd = torch.randn(2, 9, 4, 100, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            flash_attn_ext.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 7, 20, causal=True, block_table=table)
            flash_attn_ext.flash_attn_func(qd, qd, qd[..., :64], causal=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
