"""Model-shaped presets with random weights drawn on the device: what benchmarks and
``oasis serve <preset>`` run when no checkpoint is wanted.

Its own module, so that the server (:mod:`oasiskv.serve.cli`) and the benchmarks
(:mod:`oasiskv.bench`) share it without the server importing the benchmarks.
:meth:`CausalLM.random <oasiskv.models.transformer.CausalLM.random>` draws on the CPU, every
tensor from one seeded generator (reproducible across devices, minutes for 8B parameters);
:func:`random_model` draws on the target device (seconds), for benchmarks where only the shapes
matter. :meth:`TPCausalLM.random <oasiskv.models.tp.TPCausalLM.random>` is its sharded form.
"""

from __future__ import annotations

import torch


def random_model(cfg, dtype: torch.dtype, device: str, seed: int = 0):
    """A :class:`CausalLM` of ``cfg`` with random weights drawn on ``device`` (seconds for 8B
    parameters on a GPU, where ``CausalLM.random`` draws on the CPU): matrices ~ N(0, 0.02),
    norm weights 1."""
    from .transformer import CausalLM

    model = CausalLM(cfg, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, t in model.hf_tensor_slots().items():
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
    return model
