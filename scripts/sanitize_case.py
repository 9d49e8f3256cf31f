"""Small causal / ragged / GQA cases (seqlen_q != seqlen_k, headdim 64, 80 padded to 96, 128, 192, 256),
one with large-magnitude inputs (the exact P path), one with a negative softmax_scale and one with
more query tiles than SMs (the persistent sm90 forward's CTAs run several tiles), through
forward and backward on every arch path of the GPU; the forward alone at d192 / d256 with several
tiles per CTA (O staged in the V ring) and the varlen forward's dynamic walk; packed varlen batches with zero-length
sequences (forward and backward); KV-cache decode steps (contiguous and paged, append, split-KV
with the combine); every other dense case, one varlen and two KV-cache cases with attention sinks
(float32 per head: the forward's sink load and share, the combine's extra partial, d sinks from
the backward's workspace); attention dropout (dense d64-d256 and varlen); ALiBi (dense d64-d256,
KV-cache split and paged); for compute-sanitizer
memcheck / racecheck / synccheck (scripts/gpu_run.sh)."""

import argparse

import torch

import flash_attn_ext

argparse.ArgumentParser(description=__doc__).parse_args()  # --help before any CUDA work
torch.manual_seed(0)
paths = [False]
if torch.cuda.get_device_capability() == (9, 0) and "90a" in flash_attn_ext.build_info()["cuda_archs"]:
    paths.append(True)  # the sm80 kernels on an sm_90 GPU too
# (headdim, causal, (seqlen_q, seqlen_k), magnitude, softmax_scale, batch)
cases = [(64, True, (77, 45), 1.0, None, 2), (80, True, (45, 77), 1.0, None, 2), (128, False, (130, 70), 1.0, None, 2),
         (64, True, (150, 150), 1e4, None, 2), (128, True, (70, 130), 1.0, -0.2, 2),
         (64, True, (257, 300), 1.0, None, 40),  # more Q tiles than SMs: CTAs that run several tiles
         (192, True, (77, 145), 1.0, None, 2), (256, False, (130, 70), 1.0, None, 2),  # the sm90 roles kernels
         (256, True, (150, 150), 1e4, None, 2)]
for force_sm80 in paths:
    flash_attn_ext.force_sm80_path(force_sm80)
    for i, (headdim, causal, (sq, sk), magnitude, scale, b) in enumerate(cases):
        sinks = (2 * torch.randn(4, device="cuda")).requires_grad_() if i % 2 else None
        q = (magnitude * torch.randn(b, sq, 4, headdim, device="cuda")).bfloat16().requires_grad_()
        k = (magnitude * torch.randn(b, sk, 2, headdim, device="cuda")).bfloat16().requires_grad_()
        v = torch.randn(b, sk, 2, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, sinks=sinks)
        out.backward(torch.randn_like(out))
        assert all(torch.isfinite(t).all() for t in (out, q.grad, k.grad, v.grad))
        assert sinks is None or torch.isfinite(sinks.grad).all()
    # Varlen: mixed lengths with empty q and/or k sequences, q != k lengths, GQA.
    for headdim, causal in ((64, True), (128, False), (256, True)):
        lens_q, lens_k = [5, 0, 130, 64, 1], [9, 7, 0, 200, 1]
        cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).int()
        cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).int()
        q = torch.randn(sum(lens_q), 4, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(sum(lens_k), 2, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(sum(lens_k), 2, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        sinks = torch.randn(4, device="cuda") if headdim == 128 else None
        out = flash_attn_ext.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 130, 200, causal=causal, sinks=sinks)
        out.backward(torch.randn_like(out))
        assert all(torch.isfinite(t).all() for t in (out, q.grad, k.grad, v.grad))
    # Attention dropout (every kernel's kDropout twin: sm90 forward, rows and Roles<> backward; sm80):
    # ragged causal GQA, dense and one varlen batch with an empty sequence.
    for headdim, causal, (sq, sk) in ((64, True, (77, 145)), (128, False, (130, 70)), (192, True, (150, 150)),
                                      (256, False, (70, 130))):
        q = torch.randn(2, sq, 4, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(2, sk, 2, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        out = flash_attn_ext.flash_attn_func(q, k, v, 0.2, causal=causal)
        out.backward(torch.randn_like(out))
        assert all(torch.isfinite(t).all() for t in (out, q.grad, k.grad, v.grad))
    cu = torch.tensor([0, 40, 40, 170], device="cuda").int()
    q, k, v = (torch.randn(170, 4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flash_attn_ext.flash_attn_varlen_func(q, k, v, cu, cu, 130, 130, 0.3, causal=True)
    out.backward(torch.randn_like(out))
    assert all(torch.isfinite(t).all() for t in (out, q.grad, k.grad, v.grad))
    # ALiBi (every kernel's kAlibi twin): slopes per head or per (batch, head), ragged causal GQA.
    for headdim, causal, (sq, sk), per_batch in ((64, True, (77, 145), False), (128, False, (130, 70), True),
                                                 (192, True, (150, 150), True), (256, False, (70, 130), False)):
        q = torch.randn(2, sq, 4, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(2, sk, 2, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        slopes = torch.rand(2, 4, device="cuda") if per_batch else torch.rand(4, device="cuda")
        out = flash_attn_ext.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes)
        out.backward(torch.randn_like(out))
        assert all(torch.isfinite(t).all() for t in (out, q.grad, k.grad, v.grad))
flash_attn_ext.force_sm80_path(False)
# The forward alone with several tiles per CTA where O is staged in the V ring (the sm90 forward at
# d192 / d256: 420 tiles), causal tiles without keys between tiles with keys; d96's three
# warpgroups over 96-key tiles, causal with the partial tile at the top (257 rows: m_shift 64).
with torch.no_grad():
    for headdim, causal, (sq, sk) in ((192, True, (300, 100)), (256, False, (200, 90)), (96, True, (257, 300))):
        q = torch.randn(35, sq, 4, headdim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(35, sk, 2, headdim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        assert torch.isfinite(flash_attn_ext.flash_attn_func(q, k, v, causal=causal)).all()
    # The varlen forward's dynamic walk (sm90: a grid of one CTA per SM claiming tiles from the
    # call's counter, common/tile_scheduler.cuh): 150 sequences of 0..199 rows (a tight grid's
    # units) and 150 of 100 rows with two shorter ones (every tile of max_seqlen_q rows, the empty
    # ones skipped), several tiles per CTA; three consumer warpgroups (d64) and O staged in the V
    # ring (d256).
    for lens in ([(i * 37) % 200 for i in range(150)], [100] * 150 + [1, 0]):
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).int()
        for headdim, causal in ((64, True), (256, False)):
            q = torch.randn(sum(lens), 4, headdim, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(sum(lens), 2, headdim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            out = flash_attn_ext.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
            assert torch.isfinite(out).all()
# KV cache (one kernel path on every GPU): decode and a 3-query chunk, contiguous and paged,
# appending 2 keys, unsplit and split.
with torch.no_grad():
    for page, num_splits, seqlen_q in ((0, 1, 1), (0, 4, 3), (16, 0, 1), (64, 3, 3)):
        b, cap, hk = 3, 256, 2
        if page:
            k_cache = torch.randn(b * cap // page + 2, page, hk, 128, device="cuda", dtype=torch.bfloat16)
            table = torch.randperm(k_cache.shape[0], device="cuda")[:b * cap // page].reshape(b, -1).int()
        else:
            k_cache, table = torch.randn(b, cap, hk, 128, device="cuda", dtype=torch.bfloat16), None
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(b, seqlen_q, 8, 128, device="cuda", dtype=torch.bfloat16)
        k_new, v_new = (torch.randn(b, 2, hk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cache_seqlens = torch.tensor([0, 100, cap - 2], device="cuda", dtype=torch.int32)
        out = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                                     block_table=table, causal=True, num_splits=num_splits,
                                                     sinks=torch.randn(8, device="cuda") if seqlen_q == 3 else None)
        assert torch.isfinite(out).all()
        out = flash_attn_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens + 2,
                                                     block_table=table, causal=True, num_splits=num_splits,
                                                     alibi_slopes=torch.rand(b, 8, device="cuda"))
        assert torch.isfinite(out).all()
torch.cuda.synchronize()
print("sanitize case ok")
