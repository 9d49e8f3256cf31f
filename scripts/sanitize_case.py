"""Small causal / ragged / GQA cases (seqlen_q != seqlen_k, headdim 64, 80 padded to 96, 128),
one with large-magnitude inputs (the exact P path), one with a negative softmax_scale and one with
more query tiles than SMs (the persistent sm90 forward's CTAs run several tiles), through
forward and backward on every arch path of the GPU, for compute-sanitizer memcheck / racecheck /
synccheck (scripts/gpu_run.sh)."""

import torch

import flash_attn_ext

torch.manual_seed(0)
paths = [False]
if torch.cuda.get_device_capability() == (9, 0) and "90a" in flash_attn_ext.build_info()["cuda_archs"]:
    paths.append(True)  # the sm80 kernels on an sm_90 GPU too
# (headdim, causal, (seqlen_q, seqlen_k), magnitude, softmax_scale, batch)
cases = [(64, True, (77, 45), 1.0, None, 2), (80, True, (45, 77), 1.0, None, 2), (128, False, (130, 70), 1.0, None, 2),
         (64, True, (150, 150), 1e4, None, 2), (128, True, (70, 130), 1.0, -0.2, 2),
         (64, True, (257, 300), 1.0, None, 40)]  # more Q tiles than SMs: CTAs that run several tiles
for force_sm80 in paths:
    flash_attn_ext.force_sm80_path(force_sm80)
    for headdim, causal, (sq, sk), magnitude, scale, b in cases:
        q = (magnitude * torch.randn(b, sq, 4, headdim, device="cuda")).bfloat16().requires_grad_()
        k = (magnitude * torch.randn(b, sk, 2, headdim, device="cuda")).bfloat16().requires_grad_()
        v = torch.randn(b, sk, 2, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
        out.backward(torch.randn_like(out))
        assert all(torch.isfinite(t).all() for t in (out, q.grad, k.grad, v.grad))
torch.cuda.synchronize()
print("sanitize case ok")
