"""`python -m bench.zoo`: `fusedserve bench zoo` without the console script."""

import sys

from .cli import main

sys.exit(main())
