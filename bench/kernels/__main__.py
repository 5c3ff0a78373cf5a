"""`python -m bench.kernels`: `fusedserve bench kernels` without the console script."""

import sys

from .cli import main

sys.exit(main())
