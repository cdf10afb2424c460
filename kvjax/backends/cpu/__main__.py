"""`python -m kvjax.backends.cpu --compiler C++ [--march M]`: compile the kernels' sources
with another compiler without loading them (CI's aarch64 cross-compile check)."""

import sys

from kvjax.backends.cpu.build import main

if __name__ == "__main__":
    sys.exit(main())
