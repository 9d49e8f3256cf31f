"""flash-attn's module path, for imports ported from it: ``from flash_attn.flash_attn_interface
import flash_attn_func`` becomes ``from flash_attn_ext.flash_attn_interface import
flash_attn_func``. The same public functions as ``flash_attn_ext`` (interface.py), in flash-attn's
positional order; flash-attn's private helpers (``_flash_attn_forward``, ...) are not provided:
the raw ops are ``torch.ops.flash_attn_ext.*`` (docs/DESIGN.md)."""

from .interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                        flash_attn_with_kvcache)

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
