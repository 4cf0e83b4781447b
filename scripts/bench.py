"""Same as `jaxinfer bench` (see jaxinfer/bench/main.py), for running from a checkout with PYTHONPATH=$PWD."""

import sys

from jaxinfer.bench.main import main

if __name__ == "__main__":
    sys.exit(main())
