"""s25: is the 40 x 16K step's slowdown since s22 the sparse admission? exp_step_host with
engine.pools.DIRECT_SPARSE_PREFILL set from argv[1] (1: sparse admission, 0: through dense pages,
as s22), the rest of argv passed on."""
import runpy
import sys

import oasiskv.engine.pools as pools

pools.DIRECT_SPARSE_PREFILL = sys.argv[1] == "1"
here = sys.argv[2]
sys.argv = [here, *sys.argv[3:]]
runpy.run_path(here, run_name="__main__")
