"""The accuracy criterion every test uses (FlashAttention's rule; README.md, "Accuracy rule"):

    max |ours - ref| <= factor * max |baseline - ref| + atol

ref: the math reference in float64 (flash_attn_ext.reference.attention_ref, upcast=True);
baseline: the same math in the inputs' own dtype (upcast=False), from the same inputs.
``atol`` is a floor for where the baseline's own error can be exactly 0 while a differently
ordered (tiled) fp32 summation differs by a few fp32 ulps: float32/float64 inputs, and gradients
that are exactly 0 in exact arithmetic (e.g. dq with seqlen_k = 1, where dS = P (dP - D) = 0 but
dP and D are two fp32 sums in different orders). 1e-5 is ~400x below bf16's resolution at 1.0.
NaN anywhere fails.
"""

import torch


def default_atol(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-10, torch.float32: 2e-5}.get(dtype, 1e-5)


def check_accuracy(name, ours, ref, baseline, factor=2.0, atol=None):
    """Raise AssertionError naming ``name`` unless ``ours`` meets the criterion."""
    ours_f, ref_f, base_f = ours.double(), ref.double(), baseline.double()
    assert not torch.isnan(ours_f).any(), f"{name}: NaN in output"
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    finite = torch.isfinite(ref_f)
    # +inf LSE rows (no visible key) must match exactly.
    assert torch.equal(torch.isfinite(ours_f), finite), f"{name}: inf pattern differs from reference"
    if atol is None:
        atol = default_atol(ours.dtype)
    err = (ours_f - ref_f)[finite].abs().max().item() if finite.any() else 0.0
    base_err = (base_f - ref_f)[finite].abs().max().item() if finite.any() else 0.0
    assert err <= factor * base_err + atol, (
        f"{name}: max|ours-ref|={err:.3e} > {factor}*max|baseline-ref|={factor * base_err:.3e} + {atol:.1e}"
    )
    return err, base_err


def sdpa_math(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention's math (BHSD, the same arguments; causal
    top-left; rows that see no key are 0, as torch's math backend's safe softmax gives) computed
    in the inputs' own dtype: the baseline of the rule above where a test compares against SDPA
    (and, in float64, its reference).

    F.scaled_dot_product_attention itself is no baseline on CUDA: for float16 / bfloat16 it runs
    a fused kernel (flash, memory-efficient, cuDNN) or the math backend upcast to float32, whose
    errors are far below same-dtype math; a bound of 2x theirs failed our bf16 dQ on tiny masked
    problems (2.8x of a fused kernel's error, within the rule against same-dtype math; H100,
    2026-12-05)."""
    L, S = q.shape[-2], k.shape[-2]
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.to(s.dtype)
    empty = torch.isneginf(s).all(-1, keepdim=True)           # no visible key: 0, and no NaN in backward
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return p @ v
