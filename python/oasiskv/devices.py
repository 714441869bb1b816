"""Which device and compute dtype a model runs on: shared by :class:`~oasiskv.LLM`,
:class:`~oasiskv.LLMEngine`, ``oasis`` and ``oasis eval``, so every entry point picks the same one.

Kept apart from :mod:`oasiskv.cli` so that the evaluation harness, which the CLI imports, needs
nothing from the CLI module.
"""

from __future__ import annotations

import torch

from .errors import ConfigError, CudaUnavailableError

#: The device types OasisKV runs on (its kernels are CUDA; the CPU runs their reference).
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


def gpu_can_run_kernels() -> bool:
    """Whether torch sees a GPU and OasisKV's kernels can run on it (driver, NVRTC, a supported
    architecture: ``oasiskv._core.cuda_status()``)."""
    if not torch.cuda.is_available():
        return False
    from . import _core

    return _core.cuda_status() is None


def resolve_device(spec: str | torch.device = "auto") -> str:
    """The device ``spec`` names, checked: ``"auto"`` is the GPU when torch sees one and the
    kernels can run there (:func:`gpu_can_run_kernels`), else the CPU; ``"cpu"``, ``"cuda"`` and
    ``"cuda:N"`` (or a ``torch.device``) as given.

    Raises:
        CudaUnavailableError: a CUDA device on a machine where torch sees none (or not that index).
        ConfigError: any other device type (``"tpu"``, ``"mps"``, ``"meta"``, ...), or not a device.
    """
    if isinstance(spec, str) and spec == "auto":
        return "cuda" if gpu_can_run_kernels() else "cpu"
    if not isinstance(spec, str | torch.device):
        raise ConfigError(
            f"device must be 'auto', 'cpu', 'cuda', 'cuda:N' or a torch.device, got {type(spec).__name__}"
        )
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in SUPPORTED_DEVICE_TYPES:
        raise ConfigError(
            f"device {str(spec)!r} is not supported; OasisKV runs on {', '.join(SUPPORTED_DEVICE_TYPES)} "
            "(pass device='auto' for the GPU when there is one, else the CPU)"
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise CudaUnavailableError(
                f"device {str(spec)!r} asks for a GPU but torch sees no CUDA device here; pass "
                "device='auto' (the GPU when there is one) or device='cpu'"
            )
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise CudaUnavailableError(
                f"device {str(spec)!r}: torch sees {n} CUDA device(s), 0..{n - 1}; pass one of them"
            )
    return str(dev)


def compute_dtype(device: str | torch.device) -> torch.dtype:
    """The default model dtype: bfloat16 on a GPU, float32 on the CPU."""
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
