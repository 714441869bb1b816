"""The accuracy evaluation of OasisKV (``oasis eval``); see ``docs/EVAL.md``.

* :mod:`~oasiskv.eval.corpus` — held-out texts from installed Python sources and docs;
* :mod:`~oasiskv.eval.teacher` — teacher-forced runs through LLMEngine, lookahead recorder;
* :mod:`~oasiskv.eval.policies` — the Quest-like reference as a selection policy;
* :mod:`~oasiskv.eval.retrieval` — passkey, needle and key-value retrieval prompts;
* :mod:`~oasiskv.eval.harness` — the sections, sweeps and results file;
* :mod:`~oasiskv.eval.report` — markdown tables and plots.
"""

from __future__ import annotations

from .policies import QuestPolicy
from .teacher import DRAFTERS, LookaheadRecorder, Policy, TeacherForcing, summarize

__all__ = [
    "DRAFTERS",
    "LookaheadRecorder",
    "Policy",
    "QuestPolicy",
    "TeacherForcing",
    "summarize",
]
