"""flash_attn_ext: FlashAttention-2 (Dao 2023) as a PyTorch C++/CUDA extension.

Public API:
    flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    return_lse=False, sinks=None)
        BSHD attention with autograd (flash_attn_ext.interface), flash-attn's signature (its
        positional order) plus return_lse and sinks; sinks: attention sinks (gpt-oss);
        softcap: logit soft-capping (Gemma 2, flash-attn's softcap: logits softcap * tanh(S *
        softmax_scale / softcap); 0.0 none); dropout_p: attention dropout (its mask from torch's
        generator per call); alibi_slopes: ALiBi's per-head (or per batch and head) slopes.
        deterministic is taken either way (the backward always is); return_attn_probs=True returns
        flash-attn's (out, softmax_lse, None).
    flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)
        packed variable-length sequences, with autograd.
    flash_attn_qkvpacked_func(qkv, ...), flash_attn_kvpacked_func(q, kv, ...) and their varlen
        forms: flash-attn's packed layouts (views of the packed tensor, no copy).
    flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, ...,
        cache_seqlens=None, ..., block_table=None, ..., num_splits=0, ...): inference against a
        (paged) KV cache, split-KV; flash-attn's rotary_cos / rotary_sin, cache_batch_idx,
        cache_leftpad and softcap, and alibi_slopes and sinks.
    (Every flash_attn_* function takes flash-attn's arguments in flash-attn's positional order,
    and sinks= and return_lse= keyword-only.)
    (* : the arguments after it are keyword-only.)
    scaled_dot_product_attention(...): BHSD drop-in for torch's SDPA (flash_attn_ext.sdpa,
        loaded on first use).
    build_info() -> dict: CUDA archs / head dims compiled, CUDA and torch versions built against.
    force_sm80_path(force=True) -> bool: run the sm80 kernels on every GPU (tests, comparisons).
    torch.ops.flash_attn_ext.forward / backward: the raw ops (flash_attn_ext.ops).
Submodules loaded on first use: nn, reference, benchmark, bench, integrations, sdpa, bert_padding
(flash-attn's unpad_input / pad_input), rotary (flash-attn's apply_rotary_emb).
"""

import importlib
import importlib.util
import os
import warnings

import torch  # noqa: F401  (loads libtorch before the extension)

__version__ = "0.1.0"

_BUILD_HINT = ("Build it from the repository root with `pip install --no-build-isolation -e .` or `python setup.py "
               "build_ext --inplace` (FLASH_ATTN_EXT_CUDA_ARCHS=none for a quick CPU-only build), using the same "
               "torch that is installed now.")
try:
    from . import _C
except ImportError as e:  # pragma: no cover - depends on the install
    if importlib.util.find_spec(__name__ + "._C") is None:
        raise ImportError(f"flash_attn_ext._C (the compiled extension) is not built in {os.path.dirname(__file__)}. "
                          + _BUILD_HINT) from None
    raise ImportError("flash_attn_ext._C (the compiled extension) could not be loaded: " + str(e) + ". "
                      + _BUILD_HINT) from e


def _warn_if_sources_are_newer():
    """A source tree (an editable or in-place build: csrc/ beside the package) whose C++/CUDA files
    changed after _C was built: the compiled ops may not match this Python code (a new argument
    shows as "expected at most N argument(s)" at the first call), so say so at import. Stats only
    (~1 ms); csrc/generated/ is written by setup.py before compiling and is not counted."""
    csrc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
    so = getattr(_C, "__file__", None)
    if not so or not os.path.isdir(csrc):
        return
    built = os.path.getmtime(so)
    for root, dirs, files in os.walk(csrc):
        dirs[:] = [d for d in dirs if d != "generated"]
        for f in files:
            path = os.path.join(root, f)
            if os.path.getmtime(path) > built:
                warnings.warn(f"flash_attn_ext: {os.path.relpath(path, os.path.dirname(csrc))} changed after the "
                              f"compiled extension ({so}) was built; rebuild it (`python setup.py build_ext "
                              "--inplace` or `pip install --no-build-isolation -e .`), or the compiled ops may not "
                              "match this code", stacklevel=3)
                return


def _warn_if_torch_differs(built=None, running=None):
    """A module built against another torch release than the one imported (e.g. by `pip install .`
    without --no-build-isolation, which builds against the newest torch in a throwaway environment):
    its C++ calls into libtorch are then unchecked, so say so at import. Public versions are
    compared (the local part after '+', e.g. cu130, is not)."""
    built = built if built is not None else str(_C.build_info().get("torch_version", ""))
    running = running if running is not None else torch.__version__
    if built and built.split("+")[0] != str(running).split("+")[0]:
        warnings.warn(f"flash_attn_ext: the compiled extension was built against torch {built}, but torch {running} "
                      "is imported; rebuild it with this torch (`pip install --no-build-isolation -e .`), or its "
                      "ops may crash or misbehave", stacklevel=3)


_warn_if_sources_are_newer()
_warn_if_torch_differs()

from . import ops  # noqa: E402,F401  (fake kernels + autograd for the C++ ops)
from .interface import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)


def build_info() -> dict:
    """Facts about the compiled extension.

    Returns a dict with keys: ``with_cuda`` (bool), ``cuda_archs`` (';'-separated SMs, "" for a
    CPU-only build), ``head_dims`` (','-separated compiled CUDA head dims), ``cuda_version`` and
    ``torch_version`` (the versions the extension was built against), ``cpu`` (True: the CPU
    path is always built).
    """
    return dict(_C.build_info())


def force_sm80_path(force: bool = True) -> bool:
    """Run the sm80 (mma.sync) kernels even where another arch path would be chosen (the sm90
    wgmma kernels on an H100/H200 with an sm_90a build), or release that with ``force=False``.
    For tests and comparisons; the initial setting comes from the environment variable
    ``FLASH_ATTN_EXT_DISABLE_SM90`` (read once). Returns the previous setting. TypeError: force
    not a bool (or 0 / 1)."""
    from ._args import _as_bool
    return bool(_C.force_sm80_path(_as_bool("force", force)))


_LAZY_SUBMODULES = ("nn", "reference", "benchmark", "bench", "integrations", "sdpa", "bert_padding", "rotary")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "scaled_dot_product_attention":
        return importlib.import_module(f"{__name__}.sdpa").scaled_dot_product_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
    "scaled_dot_product_attention", "build_info", "force_sm80_path", "__version__",
]
