"""flash_attn_with_kvcache on the CPU (the CUDA kernels: tests/test_kvcache_cuda.py): attention
against contiguous and paged caches with cache_seqlens, in-place append of new keys, causal
bottom-right against the cached length, NaN in unused cache slots, bad input, the op surface."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import flash_attn_ext
from accuracy import check_accuracy
from flash_attn_ext.reference import attention_kvcache_ref


def make_cache(batch, seqlen_cache, nheads_k, headdim, dtype, page_size=0, nan_fill=True, seed=0):
    """A cache filled with random rows; paged: (num_blocks, page_size, ...) and a shuffled block
    table (batch, seqlen_cache / page_size). Unused rows are overwritten by the caller with NaN."""
    g = torch.Generator().manual_seed(seed)
    if page_size:
        max_blocks = seqlen_cache // page_size
        num_blocks = batch * max_blocks + 3
        k = torch.randn(num_blocks, page_size, nheads_k, headdim, generator=g).to(dtype)
        v = torch.randn(num_blocks, page_size, nheads_k, headdim, generator=g).to(dtype)
        table = torch.randperm(num_blocks, generator=g)[:batch * max_blocks].reshape(batch, max_blocks).int()
        return k, v, table
    k = torch.randn(batch, seqlen_cache, nheads_k, headdim, generator=g).to(dtype)
    v = torch.randn(batch, seqlen_cache, nheads_k, headdim, generator=g).to(dtype)
    return k, v, None


def poison_unused(k_cache, v_cache, block_table, used):
    """NaN into every cache row past used[b] (it must never reach the output)."""
    for b, n in enumerate(used):
        if block_table is None:
            k_cache[b, n:] = float("nan")
            v_cache[b, n:] = float("nan")
        else:
            page = k_cache.shape[1]
            for j, blk in enumerate(block_table[b].tolist()):
                lo = max(n - j * page, 0)
                if lo < page:
                    k_cache[blk, lo:] = float("nan")
                    v_cache[blk, lo:] = float("nan")


@pytest.mark.parametrize("page_size", [0, 16, 32])
@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqlen_new", [0, 2])
def test_kvcache_matches_reference(page_size, seqlen_q, causal, dtype, seqlen_new):
    batch, seqlen_cache, nheads, nheads_k, headdim = 3, 64, 4, 2, 16
    k_cache, v_cache, table = make_cache(batch, seqlen_cache, nheads_k, headdim, dtype, page_size)
    cache_seqlens = torch.tensor([0, 17, seqlen_cache - seqlen_new], dtype=torch.int32)
    poison_unused(k_cache, v_cache, table, cache_seqlens.tolist())
    q = torch.randn(batch, seqlen_q, nheads, headdim).to(dtype)
    k_new = torch.randn(batch, seqlen_new, nheads_k, headdim).to(dtype) if seqlen_new else None
    v_new = torch.randn(batch, seqlen_new, nheads_k, headdim).to(dtype) if seqlen_new else None
    out, lse = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                                      block_table=table, causal=causal, return_lse=True)
    used = cache_seqlens + seqlen_new
    if seqlen_new:  # the append wrote the new rows in place
        for b in range(batch):
            for i in range(seqlen_new):
                r = int(cache_seqlens[b]) + i
                blk, row = (int(table[b, r // page_size]), r % page_size) if page_size else (b, r)
                assert torch.equal(k_cache[blk, row], k_new[b, i]) and torch.equal(v_cache[blk, row], v_new[b, i])
    ref, ref_lse = attention_kvcache_ref(q, k_cache, v_cache, used, table, causal=causal)
    base, base_lse = attention_kvcache_ref(q, k_cache, v_cache, used, table, causal=causal, upcast=False)
    check_accuracy("out", out, ref, base)
    check_accuracy("softmax_lse", lse, ref_lse, base_lse)


def test_kvcache_int_seqlens_and_whole_cache():
    k_cache, v_cache, _ = make_cache(2, 32, 2, 16, torch.float32)
    q = torch.randn(2, 1, 2, 16)
    full = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache)
    as_int = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=32)
    dense = flash_attn_ext.flash_attn_func(q, k_cache, v_cache)
    assert torch.equal(full, dense) and torch.equal(as_int, dense)


@pytest.mark.parametrize("device,dtype", [
    ("cpu", torch.float32),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_kvcache_larger_cache_uses_its_first_entries(device, dtype, backend):
    """A contiguous cache of more entries than q's batch (a server's preallocated cache), without
    cache_batch_idx: sequence b reads and appends to entry b, flash-attn's rule; the other entries
    stay as they were. Eager and compiled, against the same call on the first entries alone."""
    k_cache, v_cache = (t.to(device) for t in make_cache(3, 32, 2, 16, dtype)[:2])
    q, k_new, v_new = (torch.randn(2, 2, h, 16).to(device, dtype) for h in (4, 2, 2))
    seqlens = torch.tensor([5, 30], dtype=torch.int32, device=device)
    k_first, v_first = k_cache[:2].clone(), v_cache[:2].clone()
    ref = flash_attn_ext.flash_attn_with_kvcache(q, k_first, v_first, k_new, v_new, cache_seqlens=seqlens,
                                                 causal=True)
    kc, vc = k_cache.clone(), v_cache.clone()
    call = flash_attn_ext.flash_attn_with_kvcache
    if backend:
        torch._dynamo.reset()
        call = torch.compile(call, fullgraph=True, backend=backend)
    out = call(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, causal=True)
    assert torch.equal(out, ref)
    assert torch.equal(kc[:2], k_first) and torch.equal(vc[:2], v_first)  # appended in place
    assert torch.equal(kc[2], k_cache[2]) and torch.equal(vc[2], v_cache[2])  # untouched
    with pytest.raises(RuntimeError, match="k_cache and v_cache have batch 1 but q has batch 2; expected at least"):
        flash_attn_ext.flash_attn_with_kvcache(q, kc[:1], vc[:1], cache_seqlens=seqlens)  # fewer entries
    with pytest.raises(RuntimeError, match="v_cache"):
        flash_attn_ext.flash_attn_with_kvcache(q, kc, vc[:2], cache_seqlens=seqlens)  # unequal caches
    one = kc[:1].expand(3, -1, -1, -1)  # an expanded cache: appending to entry 0 would change all three
    with pytest.raises(RuntimeError, match="expanded along its batch"):
        flash_attn_ext.flash_attn_with_kvcache(q[:1], one, one.clone(), k_new[:1], v_new[:1], cache_seqlens=seqlens[:1])
    read = flash_attn_ext.flash_attn_with_kvcache(q[:1], one, vc[:1].expand(3, -1, -1, -1), cache_seqlens=seqlens[:1])
    assert torch.equal(read, flash_attn_ext.flash_attn_with_kvcache(q[:1], kc[:1], vc[:1], cache_seqlens=seqlens[:1]))


def test_kvcache_no_keys_gives_zero_and_inf():
    k_cache, v_cache, _ = make_cache(2, 16, 1, 16, torch.float32)
    out, lse = flash_attn_ext.flash_attn_with_kvcache(torch.randn(2, 2, 1, 16), k_cache, v_cache,
                                                      cache_seqlens=torch.zeros(2, dtype=torch.int32),
                                                      return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()


def _args(paged=False):
    k_cache, v_cache, table = make_cache(2, 32, 2, 16, torch.float32, page_size=16 if paged else 0)
    return dict(q=torch.randn(2, 1, 4, 16), k_cache=k_cache, v_cache=v_cache,
                cache_seqlens=torch.tensor([3, 9], dtype=torch.int32), block_table=table)


@pytest.mark.parametrize("paged,change,match", [
    (False, lambda a: a.update(cache_seqlens=a["cache_seqlens"].long()), "cache_seqlens has dtype"),
    (False, lambda a: a.update(cache_seqlens=a["cache_seqlens"][:1]), "cache_seqlens has shape"),
    (False, lambda a: a.update(cache_seqlens=torch.tensor([3, 40], dtype=torch.int32)), "exceeds the cache"),
    (False, lambda a: a.update(cache_seqlens=torch.tensor([-1, 4], dtype=torch.int32)),
     r"cache_seqlens\[0\] = -1; expected >= 0"),
    (False, lambda a: a.update(k=torch.randn(2, 1, 2, 16)), "k and v .* must be given together"),
    (False, lambda a: a.update(k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16), cache_seqlens=None),
     "need cache_seqlens"),
    (False, lambda a: a.update(k=torch.randn(2, 1, 3, 16), v=torch.randn(2, 1, 3, 16)), "k has shape"),
    (False, lambda a: a.update(k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1]), "k_cache and v_cache have batch 1"),
    (False, lambda a: a.update(num_splits=129), "num_splits must be in"),
    (False, lambda a: a.update(num_splits=2**70),  # past int64: the op's message, from the user function
     r"num_splits must be in \[0, 128\] .*got 1180591620717411303424"),
    (True, lambda a: a.update(block_table=a["block_table"].long()), "block_table has dtype"),
    (True, lambda a: a.update(block_table=a["block_table"][:1]), "block_table has shape"),
    (True, lambda a: a["block_table"].fill_(99), r"block_table\[0, 0\] = 99 is outside"),
    (True, lambda a: a.update(k_cache=a["k_cache"][:, :8], v_cache=a["v_cache"][:, :8]), "page_size 8"),
    (False, lambda a: a.update(v_cache=a["v_cache"][:, :16]), "v_cache has shape"),
    # errors about the cache name it (k / v are the new keys), with its own strides
    (False, lambda a: a.update(k_cache=a["k_cache"].double(), v_cache=a["v_cache"].double()), "k_cache has dtype"),
    (False, lambda a: a.update(k_cache=a["k_cache"].transpose(1, 3), v_cache=a["v_cache"].transpose(1, 3)),
     "headdim mismatch: q has headdim 16, k_cache has 32"),
    (False, lambda a: a.update(k_cache=a["k_cache"][..., ::2], v_cache=a["v_cache"][..., ::2]),
     "headdim mismatch"),
    (False, lambda a: a.update(k_cache=a["k_cache"].transpose(2, 3).contiguous().transpose(2, 3),
                        v_cache=a["v_cache"].transpose(2, 3).contiguous().transpose(2, 3)),
     "k_cache must have a contiguous last dimension .* written in place"),
    (False, lambda a: a.update(k_cache=a["k_cache"][:1].expand(2, -1, -1, -1), v_cache=a["v_cache"][:1].expand(2, -1, -1, -1),
                        k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16)), "k_cache has stride 0"),
])
def test_kvcache_bad_input(paged, change, match):
    args = _args(paged)
    change(args)
    with pytest.raises(RuntimeError, match=match):
        flash_attn_ext.flash_attn_with_kvcache(**args)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(num_splits=2.7), "num_splits must be an int"),
    (lambda a: a.update(causal="no"), "causal must be a bool"),
])
def test_kvcache_argument_types(change, match):
    """num_splits=2.7 and causal='no' used to pass through int() / bool() (the latter as causal)."""
    args = _args()
    change(args)
    with pytest.raises(TypeError, match=match):
        flash_attn_ext.flash_attn_with_kvcache(**args)


def test_kvcache_flash_attn_keywords():
    """flash-attn's keywords port unchanged at their defaults (return_softmax_lse is return_lse);
    softcap and alibi_slopes run."""
    args = _args()
    want, want_lse = flash_attn_ext.flash_attn_with_kvcache(**args, return_lse=True)
    out, lse = flash_attn_ext.flash_attn_with_kvcache(
        **args, rotary_cos=None, rotary_sin=None, cache_batch_idx=None, cache_leftpad=None, softcap=0.0,
        rotary_interleaved=False, alibi_slopes=None, return_softmax_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    # (rotary_cos / rotary_sin / cache_batch_idx / cache_leftpad run: tests/test_kvcache_rotary.py)
    # alibi_slopes runs (tests/test_alibi.py); another shape is a RuntimeError naming it.
    with pytest.raises(RuntimeError, match="alibi_slopes has dtype torch.float32 and shape \\[3\\]"):
        flash_attn_ext.flash_attn_with_kvcache(**args, alibi_slopes=torch.ones(3))
    # softcap runs (tests/test_softcap.py); a negative one is a ValueError naming it.
    assert not torch.equal(flash_attn_ext.flash_attn_with_kvcache(**args, softcap=30.0), want)
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        flash_attn_ext.flash_attn_with_kvcache(**args, softcap=-30.0)
    with pytest.raises(TypeError, match="return_softmax_lse must be a bool"):
        flash_attn_ext.flash_attn_with_kvcache(**args, return_softmax_lse="yes")


def test_kvcache_refuses_grad():
    args = _args()
    args["q"].requires_grad_()
    with pytest.raises(RuntimeError, match="inference op without a gradient"):
        flash_attn_ext.flash_attn_with_kvcache(**args)
    with torch.no_grad():
        flash_attn_ext.flash_attn_with_kvcache(**args)


@pytest.mark.parametrize("vmapped", ["q", "k_cache"])
def test_kvcache_refuses_vmap_clearly(vmapped):
    """torch.vmap over the KV-cache op: an error naming it and the batch dimension to use instead,
    not the dispatcher's "Batching rule not implemented ... fallback path" message."""
    args = _args()
    samples = torch.stack([args[vmapped]] * 3)

    def call(x):
        return flash_attn_ext.flash_attn_with_kvcache(**dict(args, **{vmapped: x}))

    with pytest.raises(NotImplementedError, match="torch.vmap over flash_attn_with_kvcache.*batch dimension"):
        torch.vmap(call)(samples)


def test_kvcache_opcheck_and_compile():
    args = _args(paged=True)
    k_new, v_new = torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16)
    torch.library.opcheck(torch.ops.flash_attn_ext.fwd_kvcache.default,
                          (args["q"], args["k_cache"], args["v_cache"], k_new, v_new, args["cache_seqlens"],
                           args["block_table"], 0.25, True, 0))
    torch._dynamo.reset()

    def step(q, k_cache, v_cache, k, v, cache_seqlens, block_table):
        return flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                                      block_table=block_table, causal=True)

    kc, vc = args["k_cache"].clone(), args["v_cache"].clone()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(args["q"], kc, vc, k_new, v_new, args["cache_seqlens"], args["block_table"])
    ref = step(args["q"], args["k_cache"], args["v_cache"], k_new, v_new, args["cache_seqlens"], args["block_table"])
    assert torch.equal(out, ref)
    assert torch.equal(kc, args["k_cache"]) and torch.equal(vc, args["v_cache"])  # the compiled append happened too


def test_kvcache_paged_zero_blocks_and_batch_zero_checks():
    """A paged cache without blocks is a valid (empty) cache; batch 0 still checks the shapes."""
    q = torch.randn(2, 1, 2, 16)
    empty = torch.randn(0, 16, 2, 16)
    out, lse = flash_attn_ext.flash_attn_with_kvcache(q, empty, empty.clone(), cache_seqlens=torch.zeros(2, dtype=torch.int32),
                                                      block_table=torch.zeros(2, 1, dtype=torch.int32), return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()
    with pytest.raises(RuntimeError, match="headdim mismatch: q has headdim 16, k_cache has 8"):
        flash_attn_ext.flash_attn_with_kvcache(q[:0], torch.randn(0, 4, 2, 8), torch.randn(0, 4, 2, 8))


def test_kvcache_failed_call_leaves_cache_untouched():
    """Every value is checked before the append: an error leaves the cache as it was."""
    for paged in (False, True):
        args = _args(paged)
        before = args["k_cache"].clone(), args["v_cache"].clone()
        k_new = v_new = torch.ones(2, 1, 2, 16)
        if paged:
            args["block_table"][1, 0] = 99
        else:
            args["cache_seqlens"] = torch.tensor([0, 32], dtype=torch.int32)
        with pytest.raises(RuntimeError, match="block_table|cache_seqlens"):
            flash_attn_ext.flash_attn_with_kvcache(k=k_new, v=v_new, **args)
        assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1])


@pytest.mark.parametrize("device,dtype", [
    ("cpu", torch.float32),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_kvcache_caches_of_one_memory(device, dtype):
    """k_cache and v_cache of one memory with new keys to append: refused (the v rows overwrote the
    k rows: the k append was lost, silently), but where k is v (the same writes); without k / v the
    call may share it; two halves of one buffer (buf[0], buf[1]: one storage, no overlap) append as
    separate caches do."""
    cache = torch.randn(2, 32, 2, 16, device=device, dtype=dtype)
    q = torch.randn(2, 1, 4, 16, device=device, dtype=dtype)
    k, v = torch.randn(2, 1, 2, 16, device=device, dtype=dtype), torch.randn(2, 1, 2, 16, device=device, dtype=dtype)
    seqlens = torch.tensor([3, 9], dtype=torch.int32, device=device)
    before = cache.clone()
    with pytest.raises(RuntimeError, match="k_cache and v_cache share memory, so appending k and v would write one "
                                           "over the other"):
        flash_attn_ext.flash_attn_with_kvcache(q, cache, cache, k, v, cache_seqlens=seqlens)
    assert torch.equal(cache, before)
    both = flash_attn_ext.flash_attn_with_kvcache(q, cache, cache, k, k, cache_seqlens=seqlens)  # k is v: one write
    assert torch.equal(both, flash_attn_ext.flash_attn_with_kvcache(q, before.clone(), before.clone(), k, k,
                                                                   cache_seqlens=seqlens))
    cache.copy_(before)
    torch.testing.assert_close(flash_attn_ext.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=seqlens),
                               flash_attn_ext.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=seqlens))
    buf = torch.randn(2, 2, 32, 2, 16, device=device, dtype=dtype)
    apart = [buf[0].clone(), buf[1].clone()]
    got = flash_attn_ext.flash_attn_with_kvcache(q, buf[0], buf[1], k, v, cache_seqlens=seqlens)
    want = flash_attn_ext.flash_attn_with_kvcache(q, *apart, k, v, cache_seqlens=seqlens)
    assert torch.equal(got, want) and torch.equal(buf[0], apart[0]) and torch.equal(buf[1], apart[1])


def test_force_sm80_path_takes_bools_only():
    """force_sm80_path("no") switched the sm80 path on (bool("no") is True); a non-bool is a TypeError
    naming force, as the entries' bool arguments are."""
    with pytest.raises(TypeError, match="force must be a bool"):
        flash_attn_ext.force_sm80_path("no")
    previous = flash_attn_ext.force_sm80_path(False)
    flash_attn_ext.force_sm80_path(previous)


@pytest.mark.parametrize("device,dtype", [
    ("cpu", torch.float32),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("backend", [None, "inductor"])
def test_kvcache_append_from_the_cache_itself(device, dtype, backend):
    """New k / v (and q) that are views of the cache rows the append overwrites are read as they
    were before the call (a second engineer's case: rows 2..4 appended at row 3 gave 0 1 2 2 2 2,
    each row copied after it was overwritten), eagerly and compiled (inductor drops a copy made in
    the Python wrapper, so the op makes it)."""
    if backend == "inductor" and device == "cpu" and shutil.which("g++") is None:
        pytest.skip("inductor on CPU needs a C++ compiler")
    rows = torch.arange(8.0, device=device).view(1, 8, 1, 1).expand(1, 8, 2, 16).to(dtype).contiguous()

    def step(kc, vc):
        q = kc[:, 5:6]                                             # a cache row the append overwrites
        return flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, kc[:, 2:5], vc[:, 2:5], cache_seqlens=3,
                                                      softmax_scale=0.01)  # soft: q's value shows in out

    torch._dynamo.reset()
    run = step if backend is None else torch.compile(step, fullgraph=True, backend=backend)
    kc, vc = rows.clone(), rows.clone()
    out = run(kc, vc)
    expected = rows.clone()
    expected[:, 3:6] = rows[:, 2:5]                                # as if the new rows were copied first
    assert torch.equal(kc, expected) and torch.equal(vc, expected)
    q, k, v = rows[:, 5:6], expected[:, :6], expected[:, :6]
    torch.testing.assert_close(out, flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=0.01))
    # One storage carved into the cache and the new rows, apart (no overlap, nothing copied):
    # the same cache as from separate tensors.
    pool = torch.randn(3, 8, 2, 16, device=device).to(dtype)
    pooled = pool.clone()                                      # entries 0, 1: k_cache, v_cache; 2: new rows
    flash_attn_ext.flash_attn_with_kvcache(pool[0:1, :1], pooled[0:1], pooled[1:2], pooled[2:3, :3], pooled[2:3, :3],
                                           cache_seqlens=3)
    expected = pool[0:2].clone()
    expected[:, 3:6] = pool[2:3, :3]
    assert torch.equal(pooled[0:2], expected)


def test_kvcache_scalar_cache_seqlens():
    args = _args()
    args["cache_seqlens"] = 2**40
    with pytest.raises(RuntimeError, match=r"cache_seqlens = 1099511627776 must be in \[0, 2\^31\)"):
        flash_attn_ext.flash_attn_with_kvcache(**args)
    args["cache_seqlens"] = 2.5
    with pytest.raises(TypeError, match="cache_seqlens must be an int"):
        flash_attn_ext.flash_attn_with_kvcache(**args)


def test_kvcache_int_cache_seqlens_compiles_once():
    """A compiled decode loop that passes cache_seqlens as a Python int: one graph for every step
    after the second value (torch.compile's automatic dynamic), not a recompile per value (the
    wrapper's range check used to specialize it; fullgraph then failed at the recompile limit)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    kc, vc = torch.randn(2, 64, 2, 16), torch.randn(2, 64, 2, 16)
    q, k, v = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(fullgraph=True, backend=counter)
    def step(q, k, v, n):
        return flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=n, causal=True)

    for n in range(3, 13):
        eager_kc, eager_vc = kc.clone(), vc.clone()
        want = flash_attn_ext.flash_attn_with_kvcache(q, eager_kc, eager_vc, k, v, cache_seqlens=n, causal=True)
        assert torch.equal(step(q, k, v, n), want) and torch.equal(kc, eager_kc)
    assert counter.frame_count <= 2, counter.frame_count


@pytest.mark.parametrize("cache_batch_idx", [False, True])
def test_kvcache_new_keys_of_data_dependent_length_compile(cache_batch_idx):
    """New keys whose count comes from the data (.item()) compile with fullgraph=True and
    dynamic=True: their bound by the cache's rows (a refusal in eager calls) is a runtime assert on
    the unbacked size, not a guard (a plain comparison raised GuardOnDataDependentSymNode). The
    eager bits, the caches too."""
    kc, vc = torch.randn(2, 32, 2, 16), torch.randn(2, 32, 2, 16)
    q, k_all, v_all = torch.randn(2, 1, 4, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    seqlens = torch.tensor([3, 20], dtype=torch.int32)
    idx = torch.tensor([1, 0], dtype=torch.int32) if cache_batch_idx else None

    def step(q, k_cache, v_cache, n):
        m = n.item()
        torch._check(m >= 0)
        torch._check(m <= k_all.shape[1])
        return flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_all[:, :m], v_all[:, :m],
                                                      cache_seqlens=seqlens, cache_batch_idx=idx, causal=True)

    torch._dynamo.reset()
    eager_kc, eager_vc = kc.clone(), vc.clone()
    want = step(q, eager_kc, eager_vc, torch.tensor(5))
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        got = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")(q, kc, vc, torch.tensor(5))
    assert torch.equal(got, want) and torch.equal(kc, eager_kc) and torch.equal(vc, eager_vc)


@pytest.mark.parametrize("change", [
    lambda a: a.update(k=torch.randn(2, 1, 2, 16)),                   # k without v
    lambda a: a.update(q=torch.randn(2, 1, 3, 16)),                   # 3 heads over 2 kv heads
    lambda a: a.update(num_splits=500),
    lambda a: a.update(q=torch.randn(2, 1, 4, 12), k_cache=torch.randn(2, 32, 2, 12),
                       v_cache=torch.randn(2, 32, 2, 12)),            # head dim 12
])
def test_kvcache_fake_kernel_checks_like_the_op(change):
    """The meta (fake) kernel refuses what the op refuses (torch.compile / FakeTensor tracing)."""
    args = _args()
    change(args)
    with pytest.raises(RuntimeError):
        flash_attn_ext.flash_attn_with_kvcache(**args)
    meta = {n: (t.to("meta") if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
    with pytest.raises(RuntimeError):
        flash_attn_ext.flash_attn_with_kvcache(**meta)


# ---- The split count (csrc/kernels/common/splitkv_heuristic.h), host arithmetic: compiled here
# with the host C++ compiler against the production row (sm80/tile_config.h: SplitKvTile<128>),
# so CI checks the rule without a GPU.
_SPLITS_DRIVER = r"""
#include <cstdio>
#include "kernels/common/splitkv_heuristic.h"
#include "kernels/sm80/tile_config.h"
int main() {  // per line of stdin: arch num_sms b h h_k seqlen_q seqlen_k page_size (0: contiguous)
               // [window_left causal] (default -1 0)
  static const int table = 0;  // a non-null block_table marks a paged cache
  flash::Flash_fwd_params p{};
  char line[256];
  while (std::fgets(line, sizeof line, stdin)) {
    int causal = 0;
    p.window_left = -1;
    if (std::sscanf(line, "%d %d %d %d %d %d %d %d %d %d", &p.arch, &p.num_sms, &p.b, &p.h, &p.h_k, &p.seqlen_q,
                    &p.seqlen_k, &p.page_size, &p.window_left, &causal) < 8) {
      break;
    }
    p.is_causal = causal != 0;
    p.d = p.d_rounded = 128;
    p.block_table = p.page_size > 0 ? &table : nullptr;
    using Row = flash::sm80::SplitKvTile<128>;
    std::printf("%d\n",
                flash::num_splits_for_row(p, Row::kBlockN, Row::smem_bytes(128), Row::kMinBlocks, Row::kNWarps));
  }
}
"""


def _compile_host_driver(tmp_path, name, source):
    """`source` (C++ against csrc/'s host headers) built with the host compiler; skips without one."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler (c++, g++ or clang++) on PATH")
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    src, exe = tmp_path / f"{name}.cpp", tmp_path / name
    src.write_text(source)
    subprocess.run([cxx, "-std=c++17", f"-I{csrc}", str(src), "-o", str(exe)], check=True)
    return exe


def test_num_splits_heuristic_h200_decode(tmp_path):
    """The choices on an H200 (132 SMs), hd128 GQA 32:8, one query, a full cache: the best (or
    within 1.1 % of the best) of 12 split counts measured with benchmarks/tune_kernels.py
    (2026-12-03; docs/PERF_NOTES.md). Batches whose unsplit CTAs fit in one round stay unsplit
    (B16 / B32 / B48: 1, where the rule before chose 3 and ran 1-3 % slower); smaller batches split
    to whole CTAs per SM (B8: 2 -> 128 CTAs, not 3 -> 192); B64 (1.3 rounds unsplit) takes 3.
    Paged with pages shorter than a key tile (16 < 64 keys): every slot filled (one CTA per SM ran
    B1 128k / B8 32k / B16 8k at 0.65-0.69 of contiguous); pages of 64 / 256 as contiguous."""
    exe = _compile_host_driver(tmp_path, "splits", _SPLITS_DRIVER)
    expected = {  # (batch, seqlen_k, page_size): num_splits
        (1, 8192, 0): 16, (1, 131072, 0): 16, (2, 32768, 0): 8, (4, 32768, 0): 4, (8, 8192, 0): 2,
        (8, 32768, 0): 2, (16, 8192, 0): 1, (32, 8192, 0): 1, (48, 8192, 0): 1, (64, 8192, 0): 3,
        (64, 32768, 0): 3, (128, 8192, 0): 1,
        (1, 8192, 16): 16, (1, 131072, 16): 48, (8, 32768, 16): 6, (16, 8192, 16): 3, (32, 8192, 16): 3,
        (64, 32768, 16): 3, (1, 131072, 64): 16, (8, 32768, 256): 2, (16, 8192, 64): 1,
    }
    cases = list(expected)
    stdin = "".join(f"90 132 {b} 32 8 1 {n} {page}\n" for b, n, page in cases)
    out = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True).stdout.split()
    got = {case: int(s) for case, s in zip(cases, out)}
    assert got == expected


def test_num_splits_long_caches(tmp_path):
    """Caches past 2^20 keys take at least one split per 2^20 keys (splitkv_heuristic.h:
    splitkv_long_rows_min_splits): the split kernel's 4 warps each accumulate a quarter of every key
    tile in fp32 on the tensor cores, whose additions round toward zero, so a split of S keys puts
    S / 4 keys into one accumulator, and the forward's bound is 2^18 (README: Accuracy rule). The
    occupancy rule alone runs a grid of >= 2 CTAs per slot unsplit: a 512-query chunk over a 4M-key
    cache (1024 CTAs on 264 slots) was 1 split, 2^20 keys per accumulator. Decode grids keep
    the occupancy rule's counts where those are larger (B1 4M: 16; B64 2M: 3)."""
    exe = _compile_host_driver(tmp_path, "splits", _SPLITS_DRIVER)
    expected = {  # (batch, seqlen_q, seqlen_k[, window_left, causal]): num_splits
        (1, 512, 1 << 20): 1, (1, 512, (1 << 20) + 64): 2, (1, 512, 1 << 22): 4, (8, 512, 3 << 20): 3,
        (1, 512, 1 << 27): 128, (1, 512, (1 << 27) + 64): 128, (1, 1, 1 << 22): 16, (64, 1, 1 << 21): 3,
        # a causal window (4096, 0): a tile's 16 packed rows see <= 4096 + 16 keys, whatever
        # seqlen_q: no floor; a window with no right bound spans the queries: 2^20 + 4096 + 2 tiles
        (1, 1 << 20, 1 << 22, 4096, 1): 1, (1, 1 << 20, 1 << 22, 4096, 0): 2,
    }
    cases = list(expected)
    stdin = "".join(f"90 132 {c[0]} 32 8 {c[1]} {c[2]} 0 {' '.join(map(str, c[3:]))}\n" for c in cases)
    out = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True).stdout.split()
    got = {case: int(s) for case, s in zip(cases, out)}
    assert got == expected


_BALANCE_DRIVER = r"""
#include <cstdio>
#include "kernels/common/splitkv_heuristic.h"
#include "kernels/sm80/tile_config.h"
int main() {  // per line: b seqlen_q seqlen_k window_left softcap factor requested
  static const int lens = 0, slopes = 0;  // non-null cache_seqlens; alibi when "alibi" is 1
  flash::Flash_fwd_params p{};
  int alibi = 0;
  while (std::scanf("%d %d %d %d %f %d %d %d", &p.b, &p.seqlen_q, &p.seqlen_k, &p.window_left, &p.softcap, &alibi,
                    &p.num_splits, &p.num_blocks) == 8) {
    p.arch = 90, p.num_sms = 132, p.h = 32, p.h_k = 8, p.d = p.d_rounded = 128;
    p.cache_seqlens = p.b > 0 ? &lens : nullptr;
    p.alibi_slopes_ptr = alibi ? reinterpret_cast<const float*>(&slopes) : nullptr;
    if (p.b < 0) p.b = -p.b;
    using Row = flash::sm80::SplitKvTile<128>;
    const int equal = p.num_blocks > 0 ? p.num_blocks
                                       : flash::num_splits_for_row(p, Row::kBlockN, Row::smem_bytes(128),
                                                                   Row::kMinBlocks, Row::kNWarps);
    std::printf("%d %d\n", equal, flash::balanced_splits_units(p, equal, p.num_blocks, p.num_splits));
  }
}
"""


def test_balanced_splits_units(tmp_path):
    """The balanced splits' grid (csrc/kernels/common/splitkv_heuristic.h: balanced_splits_units;
    FLASH_ATTN_EXT_SPLITKV_BALANCE = the factor F), host arithmetic compiled here: max(2, F S) units
    per sequence for decode grids of at most one CTA per SM unsplit (H200: 132 SMs, hd128 GQA
    32:8: B16, not B17 or B32), at most one per 512 keys of the capacity, a requested count as is;
    none (0) for one sequence, no cache_seqlens, F = 0, a window's left bound, softcap, ALiBi, B64
    (four rounds unsplit) or a prefill chunk (seqlen_q 4096)."""
    exe = _compile_host_driver(tmp_path, "balance", _BALANCE_DRIVER)
    # (b (negative: no cache_seqlens), seqlen_q, seqlen_k, window_left, softcap, alibi, F, requested):
    # (the shapes' count S, units)
    expected = {
        (8, 1, 32768, -1, 0, 0, 2, 0): (2, 4), (8, 1, 32768, -1, 0, 0, 1, 0): (2, 2),
        (8, 1, 32768, -1, 0, 0, 0, 0): (2, 0), (16, 1, 8192, -1, 0, 0, 2, 0): (1, 2),
        (32, 1, 8192, -1, 0, 0, 2, 0): (1, 0), (4, 1, 32768, -1, 0, 0, 2, 0): (4, 8),
        (16, 1, 1024, -1, 0, 0, 2, 0): (1, 2), (17, 1, 1024, -1, 0, 0, 2, 0): (2, 0),
        (2, 1, 32768, -1, 0, 0, 8, 0): (8, 64), (2, 1, 1024, -1, 0, 0, 2, 0): (2, 2),
        (4, 1, 512, -1, 0, 0, 2, 0): (1, 0), (1, 1, 8192, -1, 0, 0, 2, 0): (16, 0),
        (-8, 1, 32768, -1, 0, 0, 2, 0): (2, 0), (8, 1, 32768, 1023, 0, 0, 2, 0): (2, 0),
        (8, 1, 32768, -1, 30, 0, 2, 0): (2, 0), (8, 1, 32768, -1, 0, 1, 2, 0): (2, 0),
        (64, 1, 8192, -1, 0, 0, 2, 0): (3, 0), (8, 4096, 32768, -1, 0, 0, 2, 0): (1, 0),
        (8, 1, 32768, -1, 0, 0, 2, 5): (5, 5), (8, 1, 32768, -1, 0, 0, 2, 1): (1, 0),
    }
    cases = list(expected)
    stdin = "".join(" ".join(str(x) for x in c) + "\n" for c in cases)
    out = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True).stdout.splitlines()
    got = {case: tuple(int(x) for x in line.split()) for case, line in zip(cases, out)}
    assert got == expected


_USED_ROWS_DRIVER = r"""
#include <algorithm>
#include <cstdio>
#define __host__
#define __device__
#define __forceinline__ inline
using std::max;
using std::min;
#include "kernels/common/seqlen.cuh"
int main() {  // per line of stdin: cache_seqlens[0] seqlen_knew seqlen_k
  int cached = 0;
  flash::Flash_fwd_params p{};
  p.cache_seqlens = &cached;
  while (std::scanf("%d %d %d", &cached, &p.seqlen_knew, &p.seqlen_k) == 3) {
    std::printf("%d\n", flash::SeqInfo::kv_used_rows(p, 0));
  }
}
"""


def test_kvcache_used_rows_for_any_int32_cache_seqlens(tmp_path):
    """The rows a KV-cache sequence uses on CUDA (csrc/kernels/common/seqlen.cuh: kv_used_rows,
    host arithmetic compiled here): cache_seqlens[b] + seqlen_new capped to [0, the cache's rows],
    for every int32 cache_seqlens, which CUDA calls do not read on the host. cache_seqlens = 2^31 - 1
    with one new key used to wrap negative in int and hide every key (0 rows) where the whole cache
    is meant; test_kvcache_cuda.py::test_kvcache_cache_seqlens_near_int32_max runs it on the GPU."""
    exe = _compile_host_driver(tmp_path, "used_rows", _USED_ROWS_DRIVER)
    int_max, max_seqlen = 2**31 - 1, 2**31 - 256
    cases = [(c, n, cap) for c in (-2**31, -7, -1, 0, 1, 250, 255, 256, 257, 2**31 - 256, int_max - 5, int_max)
             for n in (0, 1, 5, 256) for cap in (0, 1, 256, max_seqlen) if n <= cap]
    stdin = "".join(f"{c} {n} {cap}\n" for c, n, cap in cases)
    out = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True).stdout.split()
    got = {case: int(x) for case, x in zip(cases, out)}
    assert got == {(c, n, cap): min(max(c + n, 0), cap) for c, n, cap in cases}


def _addresses(t):
    """Every element's storage index of view t (brute force)."""
    idx = torch.zeros((), dtype=torch.int64)
    for n, s in zip(t.shape, t.stride()):
        idx = idx[..., None] + torch.arange(n) * s
    return (idx + t.storage_offset()).flatten().tolist()


def test_overlap_checks_equal_brute_force():
    """_fake_checks.has_internal_overlap / views_meet (the twins of flash_api.cpp's) against every
    element's address, on random strided views of one buffer (sizes 1..4, strides -1..40)."""
    from flash_attn_ext import _fake_checks
    gen = torch.Generator().manual_seed(0)
    buf = torch.empty(4096)
    seen = {True: 0, False: 0}
    for _ in range(3000):
        def view():
            shape = torch.randint(1, 5, (4,), generator=gen).tolist()
            stride = torch.randint(0, 41, (4,), generator=gen).tolist()
            return buf.as_strided(shape, stride, int(torch.randint(0, 200, (1,), generator=gen)))
        a, b = view(), view()
        addr_a, addr_b = _addresses(a), _addresses(b)
        internal = len(set(addr_a)) < len(addr_a)
        assert _fake_checks.has_internal_overlap(a) == internal, (a.shape, a.stride())
        meet = bool(set(addr_a) & set(addr_b))
        assert _fake_checks.views_meet(a, b) == meet, (a.shape, a.stride(), a.storage_offset(), b.shape, b.stride(),
                                                       b.storage_offset())
        seen[meet] += 1
    assert min(seen.values()) > 300  # both answers exercised


def test_kvcache_append_refuses_caches_that_overlap():
    """Caches whose append would write one element twice (a review found both accepted: the ATen
    check answers "too hard" for such views): k_cache and v_cache sharing a head of one buffer, and
    one cache whose entry 1 row 0 is entry 0 row 8 (as_strided). Refused by the op and its fake
    kernel, before any write; flash-attn's interleaved kv[:, :, 0] / kv[:, :, 1] caches and k / v
    halves of one buffer's head dim still append, as separate caches do."""
    q = torch.randn(2, 1, 2, 8, dtype=torch.float64)
    kn, vn = torch.randn(2, 1, 2, 8, dtype=torch.float64), torch.randn(2, 1, 2, 8, dtype=torch.float64)
    buf = torch.zeros(2, 32, 3, 8, dtype=torch.float64)
    one = torch.zeros(2 * 32 * 2 * 8, dtype=torch.float64).as_strided((2, 32, 2, 8), (8 * 16, 16, 8, 1))
    cases = [(buf[:, :, 0:2], buf[:, :, 1:3], "k_cache and v_cache share memory"),
             (one, torch.zeros(2, 32, 2, 8, dtype=torch.float64), r"k_cache has strides \[128, 16, 8, 1\] for shape "
              r"\[2, 32, 2, 8\], under which two of its elements share memory")]
    for kc, vc, message in cases:
        before = (kc.clone(), vc.clone())
        with pytest.raises(RuntimeError, match=message):
            flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([8, 0],
                                                                                                 dtype=torch.int32))
        assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
        bases = {}  # one meta storage per CPU storage, the views' layouts kept (.to("meta") would make
        for t in (kc, vc):  # an overlapping view contiguous)
            bases.setdefault(t.untyped_storage()._cdata, torch.empty(t.untyped_storage().nbytes() // 8,
                                                                     dtype=t.dtype, device="meta"))
        meta_kc, meta_vc = (bases[t.untyped_storage()._cdata].as_strided(t.shape, t.stride(), t.storage_offset())
                            for t in (kc, vc))
        meta = [q.to("meta"), meta_kc, meta_vc, kn.to("meta"), vn.to("meta")]
        with pytest.raises(RuntimeError, match=message):
            torch.ops.flash_attn_ext.fwd_kvcache(meta[0], meta[1], meta[2], meta[3], meta[4],
                                                 torch.zeros(2, dtype=torch.int32, device="meta"), None, 1.0, False, 0)
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    for layout in ("interleaved", "head dim halves"):
        kv = (torch.randn(2, 32, 2, 2, 8, dtype=torch.float64) if layout == "interleaved"
              else torch.randn(2, 32, 2, 16, dtype=torch.float64))
        kc, vc = (kv[:, :, 0], kv[:, :, 1]) if layout == "interleaved" else (kv[..., :8], kv[..., 8:])
        apart = (kc.clone(), vc.clone())
        got = flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens)
        want = flash_attn_ext.flash_attn_with_kvcache(q, *apart, kn, vn, cache_seqlens=seqlens)
        assert torch.equal(got, want) and torch.equal(kc, apart[0]) and torch.equal(vc, apart[1])


def test_kvcache_append_overlap_check_equals_brute_force():
    """The op's own check (flash_api.cpp) on random cache layouts: an append is refused exactly when
    two elements of a cache share an address, or the two caches one."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 1, 2, 8, dtype=torch.float64)
    kn, vn = torch.randn(2, 1, 2, 8, dtype=torch.float64), torch.randn(2, 1, 2, 8, dtype=torch.float64)
    buf = torch.zeros(8192, dtype=torch.float64)
    refused = {True: 0, False: 0}
    for _ in range(300):
        def view():  # dims 0-2 nested in a random order with padding, a stride sometimes cut short
            shape, stride, step = (2, 16, 2, 8), [0, 0, 0, 1], 8 + int(torch.randint(0, 3, (1,), generator=gen))
            for d in torch.randperm(3, generator=gen).tolist():
                cut = int(torch.randint(0, 9, (1,), generator=gen)) if torch.rand(1, generator=gen) < 0.2 else 0
                stride[d] = max(1, step - cut)
                step = stride[d] * shape[d] + int(torch.randint(0, 3, (1,), generator=gen))
            return buf.as_strided(shape, stride, int(torch.randint(0, 4000, (1,), generator=gen)))
        kc, vc = view(), view()
        a, b = _addresses(kc), _addresses(vc)
        expect = len(set(a)) < len(a) or len(set(b)) < len(b) or bool(set(a) & set(b))
        try:
            flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([0, 5],
                                                                                               dtype=torch.int32))
            got = False
        except RuntimeError as e:
            assert "share memory" in str(e), e
            got = True
        assert got == expect, (kc.stride(), kc.storage_offset(), vc.stride(), vc.storage_offset())
        refused[got] += 1
    assert min(refused.values()) > 30, refused


def test_kvcache_overlap_check_says_when_it_cannot_decide():
    """A layout the search cannot clear in 2^16 steps (a review's: k and v take alternate 16-element
    chunks of one buffer, their heads and rows permuted against each other, 131,072 rows) is refused
    with words that say so, not as memory that is shared; by the op and its fake kernel alike."""
    from flash_attn_ext import _fake_checks
    s, h, d = 131072, 2, 16
    buf = torch.zeros(2 * s * h * d)
    kc = buf.as_strided((1, s, h, d), (2 * s * h * d, 2 * h * d, 2 * d, 1), 0)
    vc = buf.as_strided((1, s, h, d), (2 * h * s * d, 2 * d, 2 * s * d, 1), d)
    assert _fake_checks.views_meet(kc, vc) is None
    q, kn, vn = torch.randn(1, 1, h, d), torch.randn(1, 1, h, d), torch.randn(1, 1, h, d)
    message = r"k_cache and v_cache may share memory \(views of one buffer whose strides the check could not clear"
    with pytest.raises(RuntimeError, match=message):
        flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=0)
    base = torch.empty(buf.shape, device="meta")
    meta_kc, meta_vc = (base.as_strided(t.shape, t.stride(), t.storage_offset()) for t in (kc, vc))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.flash_attn_ext.fwd_kvcache(q.to("meta"), meta_kc, meta_vc, kn.to("meta"), vn.to("meta"),
                                             torch.zeros(1, dtype=torch.int32, device="meta"), None, 1.0, False, 0)
