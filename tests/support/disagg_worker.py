"""The prefill worker of ``tests/disagg/test_disagg.py``'s loopback test, run as its own process
from ``tests/``: ``python -m support.disagg_worker ADDR JOBS_JSON [TOKEN]`` builds the tests' tiny
model, stages one prompt per job in the daemon at ``ADDR`` (``oasiskv.disagg.PrefillWorker``) and
prints each ``StagedRequest`` as one JSON line, in job order. A job: ``prompt_len``,
``prompt_seed``, ``block_size``, ``top_k_blocks``, ``sparse_threshold``, ``first_query``."""

from __future__ import annotations

import json
import sys

from oasiskv import KvConfig
from oasiskv.disagg import PrefillWorker
from support.fakes import prompt, tiny


def main() -> None:
    addr, jobs = sys.argv[1], json.loads(sys.argv[2])
    token = sys.argv[3] if len(sys.argv) > 3 else None
    model = tiny()
    for job in jobs:
        kv = KvConfig.fast(
            block_size=job["block_size"],
            top_k_blocks=job["top_k_blocks"],
            sparse_threshold=job["sparse_threshold"],
        )
        worker = PrefillWorker(model, kv, addr, token=token, first_query=job["first_query"], timeout_s=30)
        handle = worker.prefill(prompt(job["prompt_len"], job["prompt_seed"]))
        worker.close()
        print(handle.to_json(), flush=True)


if __name__ == "__main__":
    main()
