"""Hugging Face transformers integration (transformers 5.x).

    import flash_attn_ext.integrations as fx
    name = fx.register_transformers()            # "fa_ext"
    model = AutoModel.from_pretrained(path, attn_implementation=name)

Why the name is ``"fa_ext"`` and not ``"flash_attn_ext"``: transformers 5.x treats every
``attn_implementation`` whose name contains the substring ``"flash"`` as a Flash-Attention-package
variant (``transformers.utils.generic.is_flash_attention_requested``): ``from_pretrained`` then
tries to load a kernel of that name from the Hub and fails, and models change their masking,
generation and packing paths for it. So the registered name must not contain "flash";
``register_transformers`` refuses such a name with that explanation.

What is registered:
  * ``AttentionInterface[name] = flash_attn_ext_attention_forward``;
  * ``AttentionMaskInterface[name] = transformers.masking_utils.sdpa_mask``: the model builds the
    same masks as for ``attn_implementation="sdpa"`` (None when nothing is masked beyond plain
    causal/bidirectional attention, else a 4-D boolean mask). Without this registration
    transformers would silently drop padding masks for an unknown implementation name.

Masks (never ignored):
  * None: one kernel call for the whole batch (causal per ``module.is_causal`` / ``is_causal``).
  * A 4-D mask (batch or 1, 1, q_len, kv_len), boolean (True = attend) or additive float
    (0 = attend, -inf or dtype-min = blocked): unpad, varlen, pad, as flash-attn's transformers
    path. For each batch element (vectorized over the batch) the queries that see some key and
    the keys seen by some query take part, and the mask restricted to them must be all-True
    (padding only) or causal with a diagonal offset (query i sees key j <= i + off: causal +
    padding). That covers left padding and decoding or chunked prefill with a cache
    (bottom-right, off = kv_len - q_len) and right padding under a causal mask: transformers
    then builds the top-left pattern (off = 0) in which each real query row sees the real keys
    up to itself (plain causal attention) and each pad query row sees every real key. The
    bottom-right causal rows of all batch elements are packed into one causal
    ``flash_attn_varlen_func`` call, the rows that see every key of their element (all-True
    elements, right-padding pad rows) into one non-causal call; the outputs are scattered back
    into a zero tensor, so every row equals sdpa's and rows that see no key are 0. So at most
    two kernel launches per layer whatever the batch without a window (one dense call when
    nothing is masked; windows below),
    differentiable; the analysis (an O(q_len kv_len) pass and a few host syncs: sizes and
    max_seqlen, a constant number, not one per sequence) runs once per mask tensor, so once per
    forward for the layers that share it (``masked.plan_for``). Under ``torch.compile`` (no host
    syncs there) the
    same two calls run in a static-shape form (``masked.masked_attention_traced``: no unpadding, the
    gaps between the sequences as filler sequences, the pattern checked on the device), so
    ``fullgraph=True`` and CUDA graphs work; transformers (torch < 2.14) builds a 4-D mask
    while tracing even without padding. A layer's ``sliding_window`` (Mistral, Qwen2,
    Gemma's local layers) adds the window to the causal problems (``window_size``) and to the
    rows that see all their keys (right padding's pad rows, decode steps: one call per distinct
    count of them and kind; under torch.compile this eager path runs, a graph break). A
    bidirectional layer's window (ModernBERT's local layers: keys within sliding_window - 1 of
    the query on either side) runs as window_size (w, w): no mask, one dense call; padding, three
    varlen calls (the real rows, then the pad rows after and before the real keys that the window
    reaches: ``masked.bidirectional_window_plan``).
  * Packed sequences (padding-free training, DataCollatorWithFlattening: one row, position_ids
    restarting at each sequence): the block-diagonal mask transformers builds from position_ids
    without a cache (each block causal, with the layer's window, or full) → one varlen call
    over the flattened batch (``masked.packed_plan``). With a cache on, transformers builds no
    mask (or a window's without the packing) and sdpa attends across the sequences; here, where
    the mask is None or has no padding, the packing is read as transformers' flash-attention
    path reads it: the collator's ``cu_seq_lens_*`` / ``max_length_*`` keywords, else
    ``position_ids`` of a batch of one that restart (``_packed_from_kwargs``); a
    padding mask is taken as is (that path unpads by it). Under torch.compile only the keywords
    (fullgraph works with them): restarting position_ids without them fail a device-side assert.
  * Chunked attention (Llama 4's local layers, ``config.attention_chunk_size``: each token sees
    the earlier tokens of its chunk) runs as packed sequences (the chunks of an unpadded batch),
    in decode steps and within a chunk; a chunk boundary inside a padded sequence or a multi-token
    step after a cache (or another pattern) on such a layer raises NotImplementedError naming the
    chunked attention beside the pattern. Under torch.compile the traced path (no packed sequences
    from a mask there) runs them in one-token decode steps and within a chunk; for a multi-token
    call past one, padded or not, its device-side assert names the chunked attention and the ways
    out (``_traced_refusal``: for every layer of such a model, as a layer's own would cost a graph
    per layer).
  * Any other pattern (a window the layer does not pass, per-head masks, additive biases)
    raises NotImplementedError naming the cause: use attn_implementation="sdpa" for those
    models.

Logit soft-capping (Gemma 2): the model passes ``softcap=config.attn_logit_softcapping`` (50.0
for Gemma 2; None or 0 = none); it goes to every kernel call as ``softcap=`` (flash_attn_func's:
logits softcap * tanh(scaling * q.k / softcap)), so the result is Gemma 2's
``eager_attention_forward``'s.

Attention sinks (gpt-oss): the model passes ``s_aux=self.sinks``, one logit per query head of an
extra key that every query sees and whose value is zero (``sinks`` is accepted as an alias); it
goes to every kernel call as ``sinks=`` (dense, and each varlen call of the masked path), so the
result is its ``eager_attention_forward``'s (rows that see no key are 0 there too) and the sinks
parameter gets its gradient.
"""

from __future__ import annotations

import itertools
import sys
import threading
import weakref

import torch

from ._args import _cut, _dropout_p, _kernel_layout, _softcap
from .interface import flash_attn_func
from . import masked
from .masked import MaskNotSupported, allowed_from_mask, masked_attention
from .sdpa import _autocast_and_check_dtype

__all__ = ["register_transformers", "flash_attn_ext_attention_forward", "DEFAULT_NAME"]

DEFAULT_NAME = "fa_ext"


_POSITION_IDS_SEEN = [None, None, None]  # [weakref to a position_ids tensor, its _version, the result]
_FORWARD = threading.local()  # per thread: epoch (a count), seen (ids of the modules called in it), last layer_idx
_EPOCHS = itertools.count()


def _forward_epoch(module) -> int:
    """A model forward's number, the key of inference tensors' analyses (masked.tensor_version: they
    keep no version, so a buffer rewritten in place between forwards must not reuse one), per
    thread: a new forward starts where an attention module already called in this one is called
    again (transformers calls each once per forward; a cross-attention module is another module),
    or where a layer_idx falls below the last one seen (another model's layers)."""
    state = _FORWARD.__dict__
    idx = getattr(module, "layer_idx", None)
    idx = idx if isinstance(idx, int) else None
    if "epoch" not in state or id(module) in state["seen"] or (
            idx is not None and state["last"] is not None and idx < state["last"]):
        state.update(epoch=next(_EPOCHS), seen=set())
    state["seen"].add(id(module))
    state["last"] = idx
    return state["epoch"]


def _packed_from_kwargs(q_len, kv_len, batch, kwargs, mask, epoch=None):
    """Sequences packed in one batch row that transformers' mask does not describe, read as
    transformers' flash-attention path reads them (it unpads by a padding mask and otherwise takes
    the packing from these): the collator's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` /
    ``max_length_q`` / ``max_length_k`` when all four are given
    (DataCollatorWithFlattening(return_flash_attn_kwargs=True); taken as given), else
    ``position_ids`` of shape (1, L), L = q_len = kv_len > 1: a sequence starts at index 0 and
    wherever a position does not exceed the previous one (a restart, as DataCollatorWithFlattening
    writes, whatever the first position; transformers' flash-attention path cuts only where the
    row's minimum recurs: the same cuts for the collator's positions, each sequence from 0, but
    [0..5, 3..8] is one sequence there, two here). A gap (positions that skip ahead, PoSE-style
    training) stays one sequence, as that path and "sdpa" with a cache keep it (transformers' mask
    builder, used without a cache, also cuts at gaps: its mask then says so and is taken). Only for
    batch 1 (the flattened layout). The caller applies
    the packing where the mask (if any) has no padding. Returns (cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k), or None for one sequence.

    The position_ids are read on the host once per tensor and version (transformers passes one
    tensor to every layer; writes through ``.data`` or numpy, which keep the version, are not
    seen; an inference-mode tensor, which has none, once per model forward: ``epoch``). Under
    torch.compile (no host reads) they are not unpacked: restarting position_ids with no mask or
    a mask without padding (``mask``: the layer's attention_mask or None) fail a device-side
    assert that names the way out (the collator's keywords)."""
    if batch != 1:
        return None
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    if all(kwargs.get(n) is not None for n in names):
        cu_q, cu_k, max_q, max_k = (kwargs[n] for n in names)
        return cu_q.int(), cu_k.int(), int(max_q), int(max_k)
    pos = kwargs.get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or tuple(pos.shape) != (1, q_len) or \
            q_len != kv_len or q_len < 2:
        return None
    flat = pos.reshape(-1)
    if torch.compiler.is_compiling():
        packing = (flat.diff() <= 0).any()
        if mask is not None:
            packing &= allowed_from_mask(mask).diagonal(dim1=-2, dim2=-1).all()  # and no padding
        masked.assert_in_graph(~packing, "flash_attn_ext attention: packed sequences (restarting position_ids) "
                               "under torch.compile need the collator keywords (DataCollatorWithFlattening("
                               "return_flash_attn_kwargs=True))")
        return None
    version = masked.tensor_version(pos, epoch)
    ref, seen_version, result = _POSITION_IDS_SEEN
    if ref is not None and ref() is pos and seen_version == version:
        return result
    starts = torch.cat([flat.new_ones(1, dtype=torch.bool), flat.diff() <= 0]).nonzero().flatten()  # a host sync
    result = None
    if starts.numel() > 1:
        cu = torch.cat([starts, starts.new_full((1,), q_len)]).int()
        max_len = int(cu.diff().max())
        result = (cu, cu, max_len, max_len)
    _POSITION_IDS_SEEN[:] = [weakref.ref(pos), version, result]
    return result


def flash_attn_ext_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function.

    Args:
        module: the calling attention layer (``module.is_causal`` is read when ``is_causal`` is
            None).
        query: (batch, nheads, q_len, headdim); key, value: (batch, nheads_kv, kv_len, headdim),
            BHSD as transformers passes them; nheads % nheads_kv == 0 (GQA runs natively).
        attention_mask: None or a 4-D mask as built by ``sdpa_mask`` (see the module docstring).
        dropout: attention dropout probability in [0, 1) (transformers passes the layer's
            ``attention_dropout`` in training, 0.0 in eval), given to every kernel call
            (flash_attn_func's ``dropout_p``: each call draws its own mask from torch's generator);
            not with softcap or a sliding window that hides keys (NotImplementedError).
        scaling: softmax scale (default 1 / sqrt(headdim)).
        is_causal: overrides ``module.is_causal``.
        kwargs: ``softcap`` (Gemma 2 passes ``config.attn_logit_softcapping``): None or 0 for none,
            else a float > 0, given to every kernel call (logits softcap * tanh(scaling * q.k /
            softcap), Gemma 2's eager attention; flash_attn_func's ``softcap``);
            ``position_bias`` must be None;
            ``sliding_window`` (a causal layer's window of that many keys, transformers' ``kv_idx >
            q_idx - sliding_window``) runs as ``window_size=(sliding_window - 1, 0)``, a
            bidirectional layer's (ModernBERT: ``|q_idx - kv_idx| <= sliding_window - 1``) as
            ``window_size=(sliding_window - 1, sliding_window - 1)``;
            ``s_aux`` (gpt-oss passes its learnable attention sinks so: a (nheads,) parameter in
            the model dtype) or its alias ``sinks``, not both: one logit per query head of an
            extra key every query sees, with value zero (gpt-oss's ``eager_attention_forward``:
            softmax over the scores and the sink, the sink's column dropped), passed as
            ``sinks=`` to every kernel call (differentiable: the parameter gets its gradient);
            ``position_ids`` and ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` /
            ``max_length_k`` are read for packed sequences at batch 1 (the module docstring);
            others are ignored as by the sdpa path.
    Returns:
        (attn_output (batch, q_len, nheads, headdim) contiguous, None).
    Raises:
        NotImplementedError: unsupported kwargs or mask patterns, a head dim over 256; dropout > 0
            with softcap or a sliding window that hides keys.
        TypeError: float32 on CUDA outside autocast; both ``s_aux`` and ``sinks`` given; a
            softcap that is not a real number. ValueError: a negative or non-finite softcap.
        RuntimeError: sinks not of shape (nheads,), not floating or on another device
            (flash_attn_func's checks); under torch.compile, a mask that is not the pattern
            assumed (a device-side assert).
    """
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(
            "flash_attn_ext attention: `position_bias` is not supported; use "
            'attn_implementation="sdpa" or "eager" for this model')
    softcap = kwargs.get("softcap")
    softcap = 0.0 if softcap is None else _softcap(softcap)  # transformers' None: no soft-capping
    sinks = kwargs.get("s_aux")
    if kwargs.get("sinks") is not None:
        if sinks is not None:
            raise TypeError("flash_attn_ext attention: both `s_aux` and `sinks` were given; they are two names "
                            "of the same argument (the attention sinks), pass one")
        sinks = kwargs["sinks"]
    dropout = 0.0 if dropout is None else _dropout_p(dropout, "dropout", "flash_attn_ext attention")
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            "flash_attn_ext attention: output_attentions=True is not supported (the attention "
            'weights are never materialised); use attn_implementation="eager"')
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window_left = -1
    if kwargs.get("sliding_window") is not None:
        # Causal: keys i - window_left .. i; bidirectional (ModernBERT's local layers, which pass
        # half their window + 1): keys i - window_left .. i + window_left.
        window_left = int(kwargs["sliding_window"]) - 1
    q_len, kv_len = query.shape[2], key.shape[2]
    query, key, value = _autocast_and_check_dtype({"query": query, "key": key, "value": value})
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # BSHD views
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if max(d_qk, d_v) > 256:
        raise NotImplementedError(
            f"flash_attn_ext attention: head dim {d_qk} (queries, keys) / {d_v} (values) is not supported (at "
            'most 256); use attn_implementation="sdpa" for this model')
    # Values of another head dim than the queries' and keys' (multi-head latent attention:
    # DeepSeek-V2 / V3, ...) and head dims the kernels do not take (not a multiple of 8): padded
    # once here for every call below (interface.py: _kernel_layout), the default scale from d_qk.
    scaling = d_qk ** -0.5 if scaling is None else scaling
    q, k, v, d_v = _kernel_layout(q, k, v)
    compiling = torch.compiler.is_compiling()
    try:
        out = _attend(q, k, v, attention_mask, scaling, is_causal, window_left, sinks, softcap, dropout, q_len,
                      kv_len, kwargs, None if compiling else _forward_epoch(module),
                      _traced_refusal(module) if compiling and attention_mask is not None else None)
    except MaskNotSupported as e:
        chunk = _chunk_size(module)
        if chunk is not None and isinstance(e, masked.MaskPatternNotSupported):
            raise NotImplementedError(
                "flash_attn_ext attention: this layer's mask has no plan here; it is a layer with chunked attention "
                f"(config.attention_chunk_size={chunk}, Llama 4's: each token sees only the earlier tokens of its "
                "chunk), which runs only as packed sequences (no padding, each sequence from its first token), in "
                "one-token decode steps or within one chunk: a sequence that crosses a chunk boundary in a padded "
                "batch or in a multi-token step after cached tokens is not supported, nor is another mask pattern; "
                'pass such sequences unpadded (e.g. one at a time) or use attn_implementation="sdpa" for this '
                "model") from None
        raise NotImplementedError(f'flash_attn_ext attention: {e}; those are not supported, use '
                                  'attn_implementation="sdpa" for this model') from None
    return _cut(out, d_v), None


def _chunked_config(module):
    """(config.attention_chunk_size, config.layer_types) where ``module``'s model has chunked-attention
    layers (Llama 4's local layers: "chunked_attention" in config.layer_types, which transformers >= 5
    fills), else (None, None)."""
    config = getattr(module, "config", None)
    chunk, types = getattr(config, "attention_chunk_size", None), getattr(config, "layer_types", None)
    if chunk is None or not isinstance(types, (list, tuple)) or "chunked_attention" not in types:
        return None, None
    return chunk, types


def _chunk_size(module):
    """config.attention_chunk_size where ``module`` is a chunked-attention layer ("chunked_attention"
    at its layer_idx in config.layer_types: _chunked_config), else None."""
    chunk, types = _chunked_config(module)
    idx = getattr(module, "layer_idx", None)
    if chunk is not None and isinstance(idx, int) and 0 <= idx < len(types) and types[idx] == "chunked_attention":
        return chunk
    return None


def _traced_refusal(module):
    """The message of masked_attention_traced's device-side pattern check for ``module``'s model
    (None: its own): in a model with chunked-attention layers (Llama 4, _chunk_size), whose masks
    past one chunk are neither padding nor causal + padding, one that names the chunked attention
    and the ways out. Read from the config, for every layer of such a model: the layer's own kind
    (its layer_idx) would be a guard per layer, so a model whose layers are compiled one by one
    (torch.compile of each decoder layer) would compile a graph per layer, past torch's recompile
    limit, rather than one per kind of layer; the message names the rule first, true of the
    model's full layers too."""
    chunk, _ = _chunked_config(module)
    if chunk is None:
        return None
    return (f"flash_attn_ext: under torch.compile a mask must be padding or causal+padding; chunked attention "
            f"(config.attention_chunk_size={chunk}) past one chunk is neither: run it without torch.compile "
            "(unpadded) or with attn_implementation=sdpa")


_PACKED_MASK_SEEN = [None, None, None, None]  # [weakref to a mask, its version, weakref to cu_seqlens, the answer]


def _mask_is_the_packing(attention_mask, cu, is_causal, window_left, epoch=None):
    """Whether a layer's mask, given packed sequences read from position_ids or the collator's
    keywords (cu: their cu_seqlens), is to be run as that packing: it has no padding (every row
    sees itself: a sliding window's mask, the user's all-ones one, transformers' block-diagonal
    one; a padding mask is taken as is, as transformers' flash-attention path unpads by it and
    ignores position_ids) and, within each sequence, it is the layer's pattern (causal and / or
    the window; across sequences anything, the packing cuts it). Then the packed call runs
    without the mask's analysis. One host read per mask and cu_seqlens (transformers hands every
    layer the same ones; an inference tensor's once per ``epoch``); under torch.compile a
    device-side assert instead (and True)."""
    compiling = torch.compiler.is_compiling()
    if not compiling:
        version = masked.tensor_version(attention_mask, epoch)
        ref, seen_version, cu_ref, answer = _PACKED_MASK_SEEN
        if ref is not None and ref() is attention_mask and seen_version == version and cu_ref() is cu:
            return answer
    L = attention_mask.shape[-1]
    pos = torch.arange(L, device=attention_mask.device)
    seq = torch.searchsorted(cu[1:], pos.to(cu.dtype), right=True)
    same = seq[:, None] == seq[None, :]
    i, j = pos[:, None], pos[None, :]
    expected = same & ((i - j).abs() <= window_left) if window_left >= 0 else same
    if is_causal:
        expected &= j <= i
    allowed = allowed_from_mask(attention_mask)
    if compiling:
        masked.assert_in_graph(((allowed & same) == expected).all(), "flash_attn_ext attention: under torch.compile "
                               "the attention mask of packed sequences must be the layer's pattern in each sequence")
        return True
    answer = bool(allowed.diagonal(dim1=-2, dim2=-1).all() & ((allowed & same) == expected).all())  # a host read
    _PACKED_MASK_SEEN[:] = [weakref.ref(attention_mask), version, weakref.ref(cu), answer]
    return answer


def _attend(q, k, v, attention_mask, scaling, is_causal, window_left, sinks, softcap, dropout, q_len, kv_len, kwargs,
            epoch=None, traced_refusal=None):
    """flash_attn_ext_attention_forward's calls on the BSHD q, k, v of one head dim; returns the
    (batch, q_len, nheads, headdim) output. epoch: the model forward's (_forward_epoch);
    traced_refusal: under torch.compile, the mask pattern check's message (_traced_refusal)."""
    packed = _packed_from_kwargs(q_len, kv_len, q.shape[0], kwargs, attention_mask, epoch)
    if attention_mask is not None and (packed is None or q_len != kv_len or not _mask_is_the_packing(
            attention_mask, packed[0], is_causal, window_left, epoch)):
        return masked_attention(q, k, v, attention_mask, scaling, window_left, sinks, not is_causal, softcap, dropout,
                                epoch, traced_refusal)
    if packed is not None:
        cu_q, cu_k, max_q, max_k = packed
        return masked.varlen_flat(q, k, v, cu_q, cu_k, max_q, max_k, scaling, bool(is_causal), window_left, sinks,
                                  softcap, dropout)
    # No mask: transformers' sdpa_mask returned None, so the pattern is plain causal or plain
    # bidirectional. As the sdpa path: one query token sees everything; with kv_len > q_len
    # (prefill into an empty static cache) the keys beyond q_len are empty slots: drop them.
    causal = bool(is_causal) and q_len > 1
    if causal and kv_len > q_len:
        k, v = k[:, :q_len], v[:, :q_len]
    # right bound 0 for causal layers (decode's one query too), window_left for bidirectional ones
    window = (window_left, 0 if is_causal else window_left) if window_left >= 0 else (-1, -1)
    return flash_attn_func(q, k, v, dropout, softmax_scale=scaling, causal=causal, window_size=window, sinks=sinks,
                           softcap=softcap)


def register_transformers(name: str = DEFAULT_NAME) -> str:
    """Register flash_attn_ext as a transformers attention implementation; returns ``name``.

    After this, ``from_pretrained(..., attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` use flash_attn_ext. Idempotent.

    Models whose attention code does not call transformers' AttentionInterface (BLOOM, XGLM,
    MPT, DeBERTa-v2, GPT-Neo, ...: their modeling module never imports ALL_ATTENTION_FUNCTIONS)
    then refuse ``name`` with a ValueError when built with it: transformers would accept it,
    never call flash_attn_ext, and hand their own attention code sdpa's masks (None where nothing
    is padded: no causal mask there, silently wrong logits). (set_attn_implementation on such a
    model is a no-op with a warning in transformers.)

    Raises:
        ImportError: transformers is not installed.
        ValueError: ``name`` contains "flash" (transformers 5.x would treat it as a Hub
            flash-attention kernel; see the module docstring) or is a built-in name.
    """
    if "flash" in name.lower():
        raise ValueError(
            f"register_transformers: name {name!r} contains 'flash'; transformers treats such "
            "attn_implementation names as Flash-Attention kernels to fetch from the Hub, so "
            f"pick a name without it (default {DEFAULT_NAME!r})")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        raise ImportError("register_transformers needs transformers >= 5.0 "
                          "(pip install transformers): " + str(e)) from e
    if name in ("sdpa", "eager", "flex_attention", "paged|eager"):
        raise ValueError(f"register_transformers: {name!r} is a built-in implementation name")
    AttentionInterface.register(name, flash_attn_ext_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    _REGISTERED.add(name)
    _guard_models_outside_the_interface()
    return name


_REGISTERED: set[str] = set()


def _uses_attention_interface(model) -> bool:
    """Whether ``model``'s attention goes through transformers' AttentionInterface: the modeling
    module of its class or of a base class below PreTrainedModel (a user's subclass of
    LlamaForCausalLM lives elsewhere) imports ALL_ATTENTION_FUNCTIONS (every model that calls the
    interface does), or it is a composite model (a sub-config of a model: AutoConfig or one with
    a model_type, e.g. Llava's text and vision configs; transformers checks each sub-model on its
    own), unlike MPT's or DBRX's sub-configs of one layer's options (no model_type)."""
    from transformers import PreTrainedModel

    sub_configs = getattr(getattr(model, "config", None), "sub_configs", None) or {}
    if any(c.__name__ == "AutoConfig" or getattr(c, "model_type", "") for c in sub_configs.values()):
        return True
    for cls in type(model).__mro__:
        if cls is PreTrainedModel:
            break
        module = sys.modules.get(cls.__module__)
        if module is not None and "ALL_ATTENTION_FUNCTIONS" in vars(module) and \
                cls.__module__ != PreTrainedModel.__module__:
            return True
    return False


def _guard_models_outside_the_interface():
    """Make transformers refuse our names for models whose attention code never calls the
    AttentionInterface (BLOOM, XGLM, MPT, DeBERTa-v2, GPT-Neo, ...). transformers 5 accepts any
    registered name for them; such a model would then never run flash_attn_ext, and the masks
    it builds for the name (sdpa's: None where nothing is padded) would reach its own attention
    code, which reads None as "no causal mask" (silently wrong logits). Wraps
    PreTrainedModel.get_correct_attn_implementation (where transformers validates a name) once;
    other names pass through unchanged."""
    from transformers import PreTrainedModel

    current = PreTrainedModel.get_correct_attn_implementation
    if getattr(current, "_flash_attn_ext_guard", False):
        return

    def get_correct_attn_implementation(self, requested_attention, *args, **kwargs):
        if requested_attention in _REGISTERED and not _uses_attention_interface(self):
            raise ValueError(
                f"{type(self).__name__} computes attention in its own code, outside transformers' "
                f"AttentionInterface, so attn_implementation={requested_attention!r} would never run "
                "flash_attn_ext (and would change the masks that code receives): use "
                'attn_implementation="sdpa" or "eager" for this model')
        return current(self, requested_attention, *args, **kwargs)

    get_correct_attn_implementation._flash_attn_ext_guard = True
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation
