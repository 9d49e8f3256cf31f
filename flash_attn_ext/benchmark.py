"""``python -m flash_attn_ext.benchmark``: the benchmark CLI, kept at its old name.

The code lives in the package flash_attn_ext.bench (see its docstring); this module re-exports
its public names.
"""

import sys

from flash_attn_ext.bench import *  # noqa: F401,F403
from flash_attn_ext.bench import __all__  # noqa: F401
from flash_attn_ext.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
