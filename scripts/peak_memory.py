"""Peak extra GPU memory of one forward + backward, ours vs SDPA's flash backend (issue 4's
memory check): B=1, H=16, N=8192, d=128, bf16, causal by default. "Extra" = peak allocated
during the call minus what was allocated before it (q, k, v, dout live outside)."""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_ext


def peak_extra_mib(fn, *args):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*args)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--nheads", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--no-causal", action="store_true")
    a = ap.parse_args()
    causal = not a.no_causal
    shape = (a.batch, a.seqlen, a.nheads, a.headdim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    def ours():
        out = flash_attn_ext.flash_attn_func(q, k, v, causal=causal)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    def sdpa_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=causal)
        out.backward(dout.transpose(1, 2))
        q.grad = k.grad = v.grad = None

    ours(), sdpa_flash()  # warm-up (workspaces, handles)
    m_ours, m_sdpa = peak_extra_mib(ours), peak_extra_mib(sdpa_flash)
    print(f"peak extra memory fwd+bwd B={a.batch} H={a.nheads} N={a.seqlen} d={a.headdim} bf16 "
          f"causal={causal}: ours {m_ours:.0f} MiB, sdpa-flash {m_sdpa:.0f} MiB, ratio {m_ours / m_sdpa:.2f}")


if __name__ == "__main__":
    main()
