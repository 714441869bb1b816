"""s25: bench.prefill --backend oasis with the chunked read-back's variants (which one changes the
logits?): default (copy-engine runs, next layer on a side stream), no side stream, the page
kernel (MAX_COPY_RUNS=-1), both off (s24's read). argv: variant tokens out.json"""
import sys

import oasiskv.engine.prefill as pf
from oasiskv.bench import prefill as bp

variant, tokens, out = sys.argv[1], sys.argv[2], sys.argv[3]
if variant in ("noside", "old"):
    orig = pf.SparsePrefill.__init__

    def init(self, eng, tr, side=None):
        orig(self, eng, tr, None)

    pf.SparsePrefill.__init__ = init
if variant in ("kernel", "old"):
    pf.MAX_COPY_RUNS = -1
sys.exit(bp.main(["--backend", "oasis", "--preset", "qwen3-8b-128k", "--tokens", tokens, "--repeat", "1",
                  "--warmup", "0", "--json", out]))
