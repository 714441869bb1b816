"""``python -m oasiskv.eval`` = ``oasis eval``."""

import sys

from .harness import build_parser, main

sys.exit(main(build_parser().parse_args()))
