"""`python -m bench.serve`: `fusedserve bench serve` without the console script."""

import sys

from .cli import main

sys.exit(main())
