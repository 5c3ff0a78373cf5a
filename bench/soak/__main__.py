"""`python -m bench.soak`: `fusedserve bench soak` without the console script."""

import sys

from .cli import main

sys.exit(main())
