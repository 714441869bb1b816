"""The construction checks of :class:`~oasiskv.llm_engine.LLMEngine` that stand apart from the
engine: the model dtypes, ``enforce_eager`` against the deprecated ``cuda_graph``, and a model
object's own device and dtype.
"""

from __future__ import annotations

import warnings

import torch

from ..errors import ConfigError

#: The compute dtypes a model may be loaded in (``dtype=None``: bfloat16 on a GPU, float32 on the CPU).
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_enforce_eager(enforce_eager, cuda_graph) -> bool:
    """``enforce_eager``, with the deprecated ``cuda_graph`` (for one release: ``cuda_graph=True``
    is ``enforce_eager=False``, now the default; ``cuda_graph=False`` is ``enforce_eager=True``)."""
    if not isinstance(enforce_eager, bool):
        raise ConfigError(f"enforce_eager must be True or False, got {enforce_eager!r}")
    if cuda_graph is None:
        return enforce_eager
    if not isinstance(cuda_graph, bool):
        raise ConfigError(
            f"cuda_graph must be True or False (deprecated: use enforce_eager), got {cuda_graph!r}"
        )
    warnings.warn(
        "cuda_graph= is deprecated and will be removed: CUDA graphs are on by default on a GPU; "
        "pass enforce_eager=True to turn them off (for cuda_graph=False), or nothing (cuda_graph=True)",
        DeprecationWarning,
        stacklevel=3,
    )
    if cuda_graph and enforce_eager:
        raise ConfigError("cuda_graph=True contradicts enforce_eager=True; pass enforce_eager alone")
    return not cuda_graph


def check_model_placement(model, device, dtype) -> None:
    """A model passed as an object stays where it is: ``device`` (other than ``"auto"``) and
    ``dtype`` (other than None) must name its own device and dtype. Moving or casting it here
    would change the caller's object under them (a model shared by two engines)."""
    from ..devices import resolve_device

    p = next(model.parameters(), None)
    if p is None:
        raise ConfigError("model has no parameters; pass a CausalLM")
    if not (isinstance(device, str) and device == "auto"):
        want = torch.device(resolve_device(device))
        if want.type != p.device.type or (want.index is not None and want.index != p.device.index):
            raise ConfigError(
                f"the model is on {p.device} but device={str(device)!r}; move it first "
                f"(model.to({str(want)!r})) or leave device out (a model object runs where it is)"
            )
    if dtype is not None and dtype != p.dtype:
        raise ConfigError(
            f"the model is in {p.dtype} but dtype={dtype}; cast it first (model.to({dtype})) or "
            "leave dtype out (a model object runs in its own dtype)"
        )
