"""`python -m kvjax.backends.cpu --compiler C++ [--march M] [--opt=-O0] [--no-link]`: compile
the kernels' sources with another compiler, e.g. a cross compiler for aarch64, without
loading them (CI's aarch64 check is tests/backends/test_cpu_cross_compile.py)."""

import sys

from kvjax.backends.cpu.build import main

if __name__ == "__main__":
    sys.exit(main())
