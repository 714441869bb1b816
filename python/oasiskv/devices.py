"""Which device and compute dtype a command runs on (shared by ``oasis`` and ``oasis eval``).

Kept apart from :mod:`oasiskv.cli` so that the evaluation harness, which the CLI imports, needs
nothing from the CLI module.
"""

from __future__ import annotations

import torch


def resolve_device(spec: str) -> str:
    """``auto``: the GPU when torch sees one and the kernels can run there, else the CPU; any
    other spec (``cpu``, ``cuda``, ``cuda:1``) as given."""
    if spec != "auto":
        return spec
    if torch.cuda.is_available():
        from . import _core

        if _core.cuda_status() is None:
            return "cuda"
    return "cpu"


def compute_dtype(device: str) -> torch.dtype:
    """The commands' default model dtype: bfloat16 on a GPU, float32 on the CPU."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32
