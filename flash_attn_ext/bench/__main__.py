"""``python -m flash_attn_ext.bench``: the same command as ``python -m flash_attn_ext.benchmark``."""

import sys

from flash_attn_ext.bench.cli import main

sys.exit(main())
