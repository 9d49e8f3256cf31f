"""torch.nn modules over flash_attn_ext's attention.

- ``FlashAttention``: the attention core as a module, BSHD q, k, v in, BSHD out.
- ``MultiheadFlashAttention``: input projections (fused QKV), grouped-query attention,
  optional rotary position embedding, output projection; called like
  ``torch.nn.MultiheadAttention(batch_first=True)``.

Both accept the dtypes of ``flash_attn_ext.flash_attn_func``: CPU float32/float64/float16/bfloat16,
CUDA float16/bfloat16. On CUDA, float32 parameters work under ``torch.autocast`` (the projections
then produce bf16/fp16 activations; the attention inputs are cast to the autocast dtype as torch's
SDPA does); outside autocast, float32 CUDA inputs raise a TypeError that says so.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from ._args import _as_bool, _as_int, _dropout_p, _real, _window
from .interface import flash_attn_func
from .masked import MaskNotSupported, allowed_from_mask, assert_in_graph, masked_attention, refuse_mask_derivatives
from .reference import visible_mask
from .sdpa import _autocast_and_check_dtype

__all__ = ["FlashAttention", "MultiheadFlashAttention", "apply_rotary", "rotary_cos_sin"]


class FlashAttention(nn.Module):
    """softmax(softmax_scale * Q K^T) V over BSHD tensors (FlashAttention-2, Dao 2023, Alg. 1).

    Args:
        softmax_scale: default 1 / sqrt(headdim).
        causal: bottom-right aligned causal mask: query i sees key j <= i + seqlen_k - seqlen_q
            (the usual mask when seqlen_q == seqlen_k).
        window_size: (left, right) sliding window, as ``flash_attn_func``'s (default (-1, -1):
            none; a causal model's window of w keys is (w - 1, 0)).
        dropout_p: attention dropout probability in [0, 1) applied in training mode only
            (``self.training``; flash_attn_func's ``dropout_p``; keyword-only; TypeError for a
            non-number, ValueError outside [0, 1), both naming it).
        Every argument is checked here: a TypeError names one of the wrong type (softmax_scale
        not a real number or None, causal not a bool, window_size not a pair of ints), a
        RuntimeError a window side below -1.

    Forward:
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim) with
        nheads % nheads_k == 0 (GQA/MQA); headdim at most 256 (one that is not a multiple of 8
        runs zero-padded, as ``flash_attn_func``'s; v's may differ). Returns (batch, seqlen_q,
        nheads, v's headdim) in the inputs' dtype.

    Raises: TypeError for mixed dtypes, a non-floating dtype, or float32 on CUDA outside
    autocast; the op's RuntimeError for bad shapes.

    Differentiable in reverse and forward mode, and usable under torch.func transforms (grad,
    vjp, jvp, jacrev, jacfwd, vmap): see ``flash_attn_ext.flash_attn_func``.
    """

    def __init__(self, softmax_scale: float | None = None, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1), *, dropout_p: float = 0.0):
        super().__init__()
        # Checked now (TypeError / RuntimeError naming the argument), not at the first forward.
        self.softmax_scale = None if softmax_scale is None else _real("softmax_scale", softmax_scale)
        self.causal = _as_bool("causal", causal)
        self.window_size = _window(window_size)
        self.dropout_p = _dropout_p(dropout_p, "dropout_p", "FlashAttention")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = _autocast_and_check_dtype({"q": q, "k": k, "v": v})
        return flash_attn_func(q, k, v, self.dropout_p if self.training else 0.0, softmax_scale=self.softmax_scale,
                               causal=self.causal, window_size=self.window_size)

    def extra_repr(self) -> str:
        window = "" if self.window_size == (-1, -1) else f", window_size={self.window_size}"
        dropout = f", dropout_p={self.dropout_p}" if self.dropout_p else ""
        return f"softmax_scale={self.softmax_scale}, causal={self.causal}{window}{dropout}"



def rotary_cos_sin(seqlen: int, headdim: int, base: float = 10000.0, device=None,
                   offset: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of rotary position embedding, shape (seqlen, headdim), in ``dtype``
    (float32 by default; float64 for float64 activations).

    RoFormer (Su et al. 2021), eq. 34 with theta_i = base^(-2i/d), i = 0..d/2-1, in the
    rotate-half layout of GPT-NeoX/LLaMA: channel c and c + d/2 form the rotated pair, so
    both halves of the table repeat the same d/2 angles. Positions are offset..offset+seqlen-1.
    """
    inv_freq = base ** (-torch.arange(0, headdim, 2, device=device, dtype=dtype) / headdim)
    pos = torch.arange(offset, offset + seqlen, device=device, dtype=dtype)
    angles = torch.outer(pos, inv_freq)                       # (seqlen, d/2): m * theta_i
    angles = torch.cat([angles, angles], dim=-1)              # (seqlen, d)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate BSHD ``x`` (batch, seqlen, nheads, headdim) by position: RoFormer eq. 34,
    x * cos + rotate_half(x) * sin with rotate_half([x1, x2]) = [-x2, x1].

    Computed in float32 (float64 for float64 x), returned in x's dtype. cos, sin: (seqlen,
    headdim) from rotary_cos_sin, float64 ones for float64 x (float32 tables would limit the
    result to float32 accuracy).
    """
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]               # broadcast over heads
    return (xf * cos + rotated * sin).to(x.dtype)


class MultiheadFlashAttention(nn.Module):
    """Multi-head attention (Vaswani et al. 2017, sec. 3.2.2) on flash_attn_ext, with optional
    grouped-query attention (Ainslie et al. 2023) and rotary position embedding (Su et al. 2021).

    Called like ``torch.nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)``, with the
    same parameter names (``in_proj_weight``, ``in_proj_bias``, ``out_proj``), so with
    ``num_kv_heads == num_heads`` and ``rotary=False`` a state_dict loads in either direction and
    the outputs agree. Swapping one for the other is a one-line change when the call passes no
    mask and ``need_weights=False``.

    Args:
        embed_dim: model width E; ``E % num_heads == 0``, headdim = E // num_heads (at most 256;
            one that is not a multiple of 8 runs zero-padded; even with ``rotary``).
        num_heads: query heads H.
        num_kv_heads: key/value heads Hk (default H); ``H % Hk == 0``. Hk < H is GQA, Hk = 1 MQA.
        bias: biases in the input and output projections.
        causal: causal self-attention (bottom-right aligned when seqlen_q != seqlen_k).
        window_size: (left, right) sliding window, as ``flash_attn_func``'s (keyword-only;
            default (-1, -1): none; a causal model's window of w keys is (w - 1, 0)); checked
            here (TypeError / RuntimeError naming it).
        rotary: apply rotary position embedding to q and k: keys at positions 0..Lk-1, queries
            at Lk-Lq..Lk-1 (the causal mask's bottom-right alignment; negative positions when
            Lq > Lk; a query chunk against the whole sequence gives those rows of the full
            self-attention).
        rotary_base: the base of the rotary frequencies (theta_i = base^(-2i/headdim)).
        device, dtype: of the parameters.
        batch_first: torch.nn.MultiheadAttention's keyword, accepted as True only (keyword-only; the
            module is batch-first: ValueError otherwise).
        dropout: attention dropout probability in [0, 1) on the attention weights, in training mode
            only (torch.nn.MultiheadAttention's ``dropout``; keyword-only here; flash_attn_func's
            ``dropout_p``, or torch SDPA's with backend="torch_sdpa").
        backend: "flash_attn_ext" (default) or "torch_sdpa": the same module computing the
            attention core with torch.nn.functional.scaled_dot_product_attention (same mask,
            same GQA), for comparisons such as examples/train_gpt.py.

    Parameters: ``in_proj_weight`` ((H + 2 Hk) * headdim, E): rows [Wq; Wk; Wv];
    ``in_proj_bias`` ((H + 2 Hk) * headdim,) or None; ``out_proj``: Linear(E, E).

    Raises (construction): ValueError when E or H is below 1, E is not divisible by H, H not by
    Hk, rotary with an odd headdim, a headdim above 256 with the flash_attn_ext backend, an unknown
    backend, or batch_first=False; TypeError for an E, H or num_kv_heads that is not an int (e.g.
    torch's positional dropout as num_kv_heads), causal or rotary not a bool, rotary_base not a
    real number (with rotary).

    Works as ``self_attn`` of torch.nn.TransformerEncoderLayer / TransformerDecoderLayer, in train
    and eval mode (the encoder layer's fused eval fast path is declined: ``_qkv_same_embed_dim``),
    also swapped into an encoder built with torch's attention, whose eval mode hands the layers
    nested tensors when given a src_key_padding_mask (see ``forward``'s query).

    Differences from torch.nn.MultiheadAttention: always batch-first; dropout keyword-only; no add_bias_kv,
    add_zero_attn, kdim/vdim; ``key``/``value`` may be omitted (self-attention, one fused
    matmul); ``need_weights`` must be False (attention weights are never materialised);
    ``key_padding_mask`` and ``attn_mask`` (the same for every head) run as unpadded varlen calls
    where they form padding, causal + padding or packed patterns (``forward``; in a non-causal
    call with a sliding window, padding under a symmetric window (w, w) only); with ``is_causal=True``, ``attn_mask`` is torch's causal hint
    (checked, also under torch.compile) — otherwise a clear error.

    Differentiable in reverse and forward mode, and usable under torch.func transforms
    (``torch.func.functional_call`` with grad, vjp, jvp, jacrev, jacfwd, and
    ``vmap(grad(...))`` for per-sample gradients): see ``flash_attn_ext.flash_attn_func``. A
    ``key_padding_mask`` or an ``attn_mask`` other than the causal hint runs the varlen op, which
    those transforms (vmap aside) refuse with NotImplementedError; reverse mode and
    ``torch.autograd.forward_ad`` work there too.
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None,
                 bias: bool = True, causal: bool = False, rotary: bool = False,
                 rotary_base: float = 10000.0, device=None, dtype=None, *,
                 backend: str = "flash_attn_ext", window_size: tuple[int, int] = (-1, -1), dropout: float = 0.0,
                 batch_first: bool = True):
        super().__init__()
        embed_dim, num_heads = _as_int("embed_dim", embed_dim), _as_int("num_heads", num_heads)
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if value < 1:
                raise ValueError(f"MultiheadFlashAttention: {name} must be >= 1, got {value}")
        if num_kv_heads is not None and (isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int)):
            raise TypeError(f"MultiheadFlashAttention: num_kv_heads (the third positional argument) must be an int "
                            f"or None, got {num_kv_heads!r}; torch.nn.MultiheadAttention's third is dropout, "
                            "which this module takes by keyword (dropout=...)")
        if batch_first is not True:
            raise ValueError("MultiheadFlashAttention is always batch-first ((batch, seq, embed_dim) inputs); got "
                             f"batch_first={batch_first!r}: transpose the inputs instead")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if embed_dim % num_heads != 0:
            raise ValueError(f"MultiheadFlashAttention: embed_dim ({embed_dim}) must be divisible "
                             f"by num_heads ({num_heads})")
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(f"MultiheadFlashAttention: num_heads ({num_heads}) must be a multiple "
                             f"of num_kv_heads ({num_kv_heads})")
        head_dim = embed_dim // num_heads
        if rotary and head_dim % 2 != 0:
            raise ValueError(f"MultiheadFlashAttention: rotary needs an even headdim, got {head_dim}")
        if backend not in ("flash_attn_ext", "torch_sdpa"):
            raise ValueError(f"MultiheadFlashAttention: backend must be 'flash_attn_ext' or "
                             f"'torch_sdpa', got {backend!r}")
        if backend == "flash_attn_ext" and head_dim > 256:
            raise ValueError(f"MultiheadFlashAttention: headdim = embed_dim / num_heads = {head_dim}; the "
                             "flash_attn_ext backend takes at most 256")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = head_dim
        self.causal, self.rotary = _as_bool("causal", causal), _as_bool("rotary", rotary)
        self.rotary_base = _real("rotary_base", rotary_base) if self.rotary else rotary_base
        self.backend = backend
        self.window_size = _window(window_size)  # TypeError / RuntimeError now, not at the first forward
        self.dropout = _dropout_p(dropout, "dropout", "MultiheadFlashAttention")
        self.batch_first = True  # for code that inspects nn.MultiheadAttention's attribute
        # torch.nn.TransformerEncoderLayer reads this in eval mode to choose its fused fast path,
        # which takes in_proj_weight itself and would bypass this module: False keeps it calling ours.
        self._qkv_same_embed_dim = False
        factory = {"device": device, "dtype": dtype}
        qkv_dim = (num_heads + 2 * num_kv_heads) * head_dim
        self.in_proj_weight = nn.Parameter(torch.empty(qkv_dim, embed_dim, **factory))
        self.in_proj_bias = nn.Parameter(torch.empty(qkv_dim, **factory)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self._reset_parameters()

    def _reset_parameters(self):
        # As torch.nn.MultiheadAttention: xavier-uniform in-projection, zero biases.
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def _project(self, x: torch.Tensor, part: slice, nheads: int) -> torch.Tensor:
        b = self.in_proj_bias[part] if self.in_proj_bias is not None else None
        y = F.linear(x, self.in_proj_weight[part], b)
        return y.view(x.shape[0], x.shape[1], nheads, self.head_dim)

    def _attention(self, q, k, v, causal: bool, allowed: torch.Tensor | None = None) -> torch.Tensor:
        # allowed: None, or (batch or 1, 1, seqlen_q, seqlen_k) bool, True where a query may see a
        # key by the key_padding_mask / attn_mask given (the module's causal mask and window added here).
        Lq, Lk = q.shape[1], k.shape[1]
        dropout_p = self.dropout if self.training else 0.0
        if self.backend == "flash_attn_ext":
            q, k, v = _autocast_and_check_dtype({"query": q, "key": k, "value": v})
            if allowed is None:
                return flash_attn_func(q, k, v, dropout_p, causal=causal, window_size=self.window_size)
            # A mask: the unpadded varlen calls of the masked path (flash_attn_ext.masked), with the
            # module's causal mask (and a causal window's left bound), or a symmetric window (w, w)
            # of a non-causal call as a bidirectional window (masked.bidirectional_window_plan).
            left, right = self.window_size
            bidirectional = not causal and (left, right) != (-1, -1)
            if bidirectional and (left != right or Lq != Lk):
                raise NotImplementedError(
                    f"MultiheadFlashAttention: a key_padding_mask / attn_mask with a sliding window in a non-causal "
                    f"call needs a symmetric window (w, w) and seqlen_q == seqlen_k, got window_size "
                    f"{self.window_size}, seqlen_q {Lq}, seqlen_k {Lk}; pass the masks as None or use "
                    "backend='torch_sdpa'")
            mask = allowed & visible_mask(Lq, Lk, causal, left, right, device=q.device)
            try:
                return masked_attention(q, k, v, mask, None, left if causal or bidirectional else -1,
                                        bidirectional=bidirectional, dropout_p=dropout_p)
            except MaskNotSupported as e:
                raise NotImplementedError(
                    f"MultiheadFlashAttention: with this key_padding_mask / attn_mask and the module's causal mask or "
                    f"window, {e}; padding and causal + padding patterns are supported (use backend='torch_sdpa' "
                    "for this one)") from None
        # Reference path: torch SDPA on BHSD views; an explicit bottom-right mask when the
        # alignments differ (seqlen_q != seqlen_k), a window is set or a mask is given, so both
        # backends compute the same function.
        mask = None
        if (causal and Lq != Lk) or self.window_size != (-1, -1) or allowed is not None:
            mask = visible_mask(Lq, Lk, causal, *self.window_size, device=q.device)
            if allowed is not None:
                mask = allowed & mask
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, dropout_p=dropout_p,
            is_causal=causal and mask is None, enable_gqa=self.num_kv_heads != self.num_heads)
        return out.transpose(1, 2)

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None,
                need_weights: bool = False, attn_mask: torch.Tensor | None = None,
                average_attn_weights: bool = True, is_causal: bool = False,
                ) -> tuple[torch.Tensor, None]:
        """
        Args:
            query: (batch, seqlen_q, embed_dim); or a nested tensor (batch, ragged seqlen,
                embed_dim), strided or jagged, for self-attention without masks (as
                torch.nn.TransformerEncoder passes its layers in eval mode with a
                src_key_padding_mask): run right-padded with the matching key_padding_mask,
                returned nested in the same layout.
            key, value: (batch, seqlen_k, embed_dim), both or neither; omitted means
                self-attention (key = value = query, one fused QKV matmul).
            key_padding_mask: None, or (batch, seqlen_k) as torch.nn.MultiheadAttention's: bool
                with True = padding (the key is ignored), or float with 0 = attend and -inf =
                ignored. The call then runs as the masked path's unpadded varlen calls (at most
                two; a few host syncs; under torch.compile a static-shape form) with the
                module's causal mask and a causal window, or a non-causal call's symmetric
                window (w, w) (three calls: masked.bidirectional_window_plan; seqlen_q ==
                seqlen_k); a query that sees no key gets attention 0 (its output: out_proj's
                bias).
            need_weights: must be False.
            attn_mask: None, or in torch.nn.MultiheadAttention's conventions: bool with True =
                not allowed to attend, or float with 0 / -inf. With is_causal=True, the causal
                mask itself (seqlen_q, seqlen_k) (torch's hint:
                ``torch.ones(L, L, dtype=torch.bool).triu(1)``,
                ``nn.Transformer.generate_square_subsequent_mask(L)``), verified: eagerly
                (NotImplementedError), and under torch.compile too: its shape while tracing
                (NotImplementedError; with fullgraph=True wrapped in torch._dynamo's Unsupported
                error, a RuntimeError), its values inside the graph with torch._assert_async when
                the compiled code runs (RuntimeError on CPU, a device-side assertion on CUDA).
                Without is_causal, (seqlen_q, seqlen_k) or (batch * num_heads, seqlen_q,
                seqlen_k) the same on every head: taken with key_padding_mask and the module's
                causal mask as the masked path's varlen calls where they form padding, causal +
                padding (any diagonal offset) or packed sequences.
            average_attn_weights: ignored (no weights are returned).
            is_causal: causal attention for this call (also when the module has causal=False).
        Returns:
            (out, None): out (batch, seqlen_q, embed_dim) in the activations' dtype.
        Raises:
            NotImplementedError: need_weights=True; with is_causal=True an attn_mask other than
                the causal hint (compiled: see attn_mask); a key_padding_mask / attn_mask (flash_attn_ext
                backend) with an asymmetric window in a non-causal call or seqlen_q != seqlen_k
                there, of another pattern (e.g. real keys not one run per batch element),
                differing per head, with values other than 0 / -inf, or requiring grad.
            TypeError: key_padding_mask / attn_mask neither bool nor floating; is_causal not a
                bool (or 0 / 1).
            RuntimeError: key_padding_mask, or attn_mask without is_causal, on another device
                than query; under torch.compile on CPU, an attn_mask whose values are not causal
                (with is_causal) or differ per head, or a mask not of the static form's pattern.
            ValueError: wrong ranks or widths, key without value, key_padding_mask not (batch,
                seqlen_k), attn_mask not (seqlen_q, seqlen_k) or (batch * num_heads, seqlen_q,
                seqlen_k).
        """
        if need_weights:
            raise NotImplementedError(
                "MultiheadFlashAttention: need_weights=True is not supported (attention weights "
                "are never materialised); pass need_weights=False")
        if (key is None) != (value is None):
            raise ValueError("MultiheadFlashAttention: pass both key and value, or neither")
        is_causal = _as_bool("is_causal", is_causal)
        self_attn = key is None or (key is query and value is query)
        if isinstance(query, torch.Tensor) and query.is_nested:
            return self._nested_self_attention(query, self_attn, key_padding_mask, attn_mask, is_causal)
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"MultiheadFlashAttention: query must be (batch, seqlen, "
                             f"{self.embed_dim}), got {tuple(query.shape)}")
        if not self_attn:
            for name, t in (("key", key), ("value", value)):
                if t.dim() != 3 or t.shape[-1] != self.embed_dim or t.shape[0] != query.shape[0]:
                    raise ValueError(
                        f"MultiheadFlashAttention: {name} must be (batch={query.shape[0]}, seqlen_k, "
                        f"{self.embed_dim}), got {tuple(t.shape)}")
            if key.shape[1] != value.shape[1]:
                raise ValueError("MultiheadFlashAttention: key and value must have the same seqlen, "
                                 f"got {key.shape[1]} and {value.shape[1]}")
        seqlen_k = query.shape[1] if self_attn else key.shape[1]
        causal = self.causal or is_causal
        allowed = None
        for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", None if is_causal else attn_mask)):
            if isinstance(mask, torch.Tensor) and mask.device != query.device:
                raise RuntimeError(f"MultiheadFlashAttention: {name} is on {mask.device} but query is on "
                                   f"{query.device}; expected one device")
        if key_padding_mask is not None:
            allowed = self._keys(key_padding_mask, query.shape[0], seqlen_k)[:, None, None, :]
        if attn_mask is not None and is_causal:
            self._check_causal_hint(attn_mask, query.shape[1], seqlen_k)
        elif attn_mask is not None:
            am = self._attn_mask(attn_mask, query.shape[0], query.shape[1], seqlen_k)
            allowed = am if allowed is None else allowed & am

        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self_attn:
            b = self.in_proj_bias
            qkv = F.linear(query, self.in_proj_weight, b)
            qkv = qkv.view(query.shape[0], query.shape[1], H + 2 * Hk, D)
            q, k, v = qkv.split([H, Hk, Hk], dim=2)   # BSHD views, last dim contiguous
        else:
            q = self._project(query, slice(0, H * D), H)
            k = self._project(key, slice(H * D, (H + Hk) * D), Hk)
            v = self._project(value, slice((H + Hk) * D, (H + 2 * Hk) * D), Hk)
        if self.rotary:
            # Keys at positions 0..Lk-1, queries at the last Lq of them (Lk-Lq..Lk-1: the causal
            # mask's bottom-right alignment), so a chunk of queries against the whole sequence
            # gets the rows of the full self-attention.
            table = torch.float64 if q.dtype == torch.float64 else torch.float32
            lq, lk = q.shape[1], k.shape[1]
            cos_k, sin_k = rotary_cos_sin(lk, D, self.rotary_base, device=k.device, dtype=table)
            if lq == lk:
                cos_q, sin_q = cos_k, sin_k
            else:
                cos_q, sin_q = rotary_cos_sin(lq, D, self.rotary_base, device=q.device, offset=lk - lq, dtype=table)
            q = apply_rotary(q, cos_q, sin_q)
            k = apply_rotary(k, cos_k, sin_k)
        out = self._attention(q, k, v, causal, allowed)         # (B, Lq, H, D)
        out = out.reshape(out.shape[0], out.shape[1], H * D)
        return self.out_proj(out), None

    def _nested_self_attention(self, query: torch.Tensor, self_attn: bool, key_padding_mask, attn_mask,
                               is_causal: bool) -> tuple[torch.Tensor, None]:
        """Self-attention over a nested query (batch, ragged seqlen, embed_dim), strided or jagged
        layout, as torch.nn.TransformerEncoder hands its layers in eval mode with a
        src_key_padding_mask (its sparsity fast path, chosen when the encoder was built): the
        sequences padded on the right, run with the matching key_padding_mask (the masked path's
        varlen calls), and returned nested in the query's layout. A non-causal asymmetric window,
        which the masked path does not take with padding, runs each sequence alone."""
        if not self_attn or key_padding_mask is not None or attn_mask is not None:
            raise NotImplementedError(
                "MultiheadFlashAttention: a nested query is taken for self-attention only (key and value None or "
                "the query itself) and without key_padding_mask / attn_mask (its sequence lengths are the padding)")
        rows = query.unbind()
        if getattr(query, "_ragged_idx", 1) != 1 or any(t.dim() != 2 or t.shape[1] != self.embed_dim for t in rows):
            raise ValueError(f"MultiheadFlashAttention: a nested query must be (batch, ragged seqlen, "
                             f"{self.embed_dim}), ragged in dim 1, got rows of shapes "
                             f"{[tuple(t.shape) for t in rows[:4]]}{' ...' if len(rows) > 4 else ''}")
        lengths = [t.shape[0] for t in rows]
        left, right = self.window_size
        if not (self.causal or is_causal) and left != right or not any(lengths):
            outs = [self.forward(t[None], is_causal=is_causal)[0][0] for t in rows]
            return torch.nested.as_nested_tensor(outs, layout=query.layout), None
        padded = query.to_padded_tensor(0.0)                     # (batch, longest, embed_dim)
        longest = padded.shape[1]
        padding = None
        if any(n != longest for n in lengths):
            padding = (torch.arange(longest, device=padded.device)[None, :]
                       >= torch.tensor(lengths, device=padded.device)[:, None])
        out, _ = self.forward(padded, key_padding_mask=padding, is_causal=is_causal)
        return torch.nested.as_nested_tensor([o[:n] for o, n in zip(out.unbind(), lengths)], layout=query.layout), None

    def _allowed(self, mask: torch.Tensor, name: str) -> torch.Tensor:
        """Bool "may attend" from one of torch.nn.MultiheadAttention's masks (``name``): bool with
        True = not allowed, or float with 0 = attend and -inf (or a dtype's minimum) = not."""
        if not isinstance(mask, torch.Tensor) or not (mask.dtype == torch.bool or mask.is_floating_point()):
            raise TypeError(f"MultiheadFlashAttention: {name} must be a bool (True = not allowed) or floating "
                            f"(0 / -inf) tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
        refuse_mask_derivatives(mask, f"MultiheadFlashAttention: {name}", "pass a plain (detached) mask")
        if mask.dtype == torch.bool:
            return ~mask
        try:
            return allowed_from_mask(mask)
        except MaskNotSupported as e:
            raise NotImplementedError(f"MultiheadFlashAttention: {name}: {e}") from None

    def _keys(self, key_padding_mask: torch.Tensor, batch: int, seqlen_k: int) -> torch.Tensor:
        """(batch, seqlen_k) bool, True for the keys that take part, from torch.nn.MultiheadAttention's
        key_padding_mask: bool with True = padding (ignored), or float with 0 = attend and -inf
        (or the dtype's minimum) = ignored."""
        if tuple(getattr(key_padding_mask, "shape", ())) != (batch, seqlen_k):
            raise ValueError(f"MultiheadFlashAttention: key_padding_mask must be (batch={batch}, seqlen_k={seqlen_k}), "
                             f"got {tuple(getattr(key_padding_mask, 'shape', ()))}")
        return self._allowed(key_padding_mask, "key_padding_mask")

    def _attn_mask(self, attn_mask: torch.Tensor, batch: int, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
        """(batch or 1, 1, seqlen_q, seqlen_k) bool, True where a query may see a key, from
        torch.nn.MultiheadAttention's attn_mask (without is_causal): (seqlen_q, seqlen_k) or
        (batch * num_heads, seqlen_q, seqlen_k), bool with True = not allowed, or float additive
        (0 / -inf); the same for every head."""
        shapes = ((seqlen_q, seqlen_k), (batch * self.num_heads, seqlen_q, seqlen_k))
        if tuple(getattr(attn_mask, "shape", ())) not in shapes:
            raise ValueError(f"MultiheadFlashAttention: attn_mask must be {shapes[0]} or {shapes[1]} (as "
                             f"torch.nn.MultiheadAttention's), got {tuple(getattr(attn_mask, 'shape', ()))}")
        allowed = self._allowed(attn_mask, "attn_mask")
        if allowed.dim() == 2:
            return allowed[None, None]
        allowed = allowed.view(batch, self.num_heads, seqlen_q, seqlen_k)
        msg = "MultiheadFlashAttention: an attn_mask that differs per head is not supported; use backend='torch_sdpa'"
        same = (allowed == allowed[:, :1]).all()
        if torch.compiler.is_compiling():
            assert_in_graph(same, msg)                           # no host read in a graph
        elif not bool(same):
            raise NotImplementedError(msg)
        return allowed[:, :1]

    @staticmethod
    def _check_causal_hint(attn_mask: torch.Tensor, seqlen_q: int, seqlen_k: int) -> None:
        """Check that ``attn_mask`` is the square causal mask (the is_causal hint).

        Eager: raises NotImplementedError. Under torch.compile the shape part is the same
        Python check (shapes are known while tracing; with fullgraph=True dynamo reports the
        NotImplementedError inside its Unsupported error); the values are checked inside the graph
        with ``torch._assert_async`` (no graph break, no host sync): a wrong mask raises
        RuntimeError when the compiled code runs on CPU, and is a device-side assertion on
        CUDA (which leaves the CUDA context unusable, as torch's own in-graph asserts do).
        """
        if seqlen_q != seqlen_k:
            raise NotImplementedError(
                f"MultiheadFlashAttention: is_causal=True with an attn_mask needs seqlen_q == seqlen_k "
                f"(the mask is torch's square causal hint), got seqlen_q {seqlen_q} and seqlen_k {seqlen_k}; "
                "pass attn_mask=None with is_causal=True for bottom-right aligned causal attention")
        def msg(sizes: bool = True) -> str:  # the sizes formatted only in eager text (a symbolic size
            # formatted under torch.compile would be pinned to its value: one graph per length)
            return ("MultiheadFlashAttention: with is_causal=True, attn_mask must be the square causal mask"
                    + (f" of shape ({seqlen_q}, {seqlen_k})" if sizes else "") + " (or None); other masks are "
                    "not supported")
        if tuple(attn_mask.shape) != (seqlen_q, seqlen_k):
            raise NotImplementedError(msg())
        i = torch.arange(seqlen_q, device=attn_mask.device)[:, None]
        j = torch.arange(seqlen_k, device=attn_mask.device)[None, :]
        # torch.nn.MultiheadAttention's causal hint is top-left (torch.nn.Transformer
        # .generate_square_subsequent_mask); for seqlen_q == seqlen_k it equals ours.
        expected = j <= i  # may attend
        if attn_mask.dtype == torch.bool:  # nn.MultiheadAttention: True = not allowed to attend
            ok = (attn_mask == ~expected).all()
        else:  # additive float mask: 0 = attend, -inf = blocked, nothing else
            ok = torch.where(expected, attn_mask == 0, torch.isneginf(attn_mask)).all()
        if torch.compiler.is_compiling():
            assert_in_graph(ok, msg(sizes=False))  # in-graph, data-dependent: no graph break
            return
        if not bool(ok):
            raise NotImplementedError(msg())

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, causal={self.causal}, rotary={self.rotary}, "
                f"backend={self.backend!r}" + ("" if self.window_size == (-1, -1) else f", window_size={self.window_size}")
                + (f", dropout={self.dropout}" if self.dropout else ""))
