"""``python -m oasiskv.bench.kernels``."""

import sys

from . import main

sys.exit(main())
