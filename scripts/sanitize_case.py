"""A small causal, ragged case (seqlen_q=77 > seqlen_k=45, GQA 4:2, headdim 64 and 80 padded)
through forward and backward, for compute-sanitizer memcheck / racecheck (scripts/gpu_run.sh)."""

import torch

import flash_attn_ext

torch.manual_seed(0)
for headdim, causal, (sq, sk) in [(64, True, (77, 45)), (80, True, (45, 77)), (128, False, (130, 70))]:
    q = torch.randn(2, sq, 4, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, sk, 2, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, sk, 2, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = flash_attn_ext.flash_attn_func(q, k, v, causal=causal)
    out.backward(torch.randn_like(out))
torch.cuda.synchronize()
print("sanitize case ok")
