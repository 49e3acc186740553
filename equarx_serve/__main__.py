"""`python -m equarx_serve` runs the `equarx-serve` command line."""

import sys

from equarx_serve.cli import main

sys.exit(main())
