"""Attention benchmark: flash_attn_ext vs SDPA backends, standard attention and FlashAttention.

A thin wrapper of ``python -m flash_attn_ext.benchmark`` (same flags; ``--help`` lists them).
"""

import sys

from flash_attn_ext.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
