"""`python -m bench.pool`: `fusedserve bench pool` without the console script."""

import sys

from .cli import main

sys.exit(main())
