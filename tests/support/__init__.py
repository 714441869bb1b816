"""What the tests share, importable as ``support.*`` from any folder of ``tests/``
(``tests/conftest.py`` puts ``tests/`` on ``sys.path``). Test modules import from here, never
from each other (``tests/test_layout.py`` checks).

* :mod:`support.fakes`: stand-in tokenizers, the tiny random model, repetitive prompts, engine
  checks (``drain``, ``pools_are_full``);
* :mod:`support.configs`: one ``ModelConfig`` per model shape the tests use;
* :mod:`support.reference`, :mod:`support.fused_reference`, :mod:`support.key_codes`: the
  independent float64 references of the kernels and their tolerance table;
* :mod:`support.kernels`: the GPU kernel tests' poison, bit-exact checks and random draws;
* :mod:`support.engines`, :mod:`support.sampling`, :mod:`support.eagle3`,
  :mod:`support.parallel`: what the engine, speculative, EAGLE-3 and tensor-parallel tests share;
* :mod:`support.checkpoints`, :mod:`support.hf_models`: tiny checkpoints written to disk
  (HF directory, GGUF) and transformers' own models on random weights;
* :mod:`support.rtd`, :mod:`support.disagg_worker`: the staging daemon and the prefill worker
  process of the disaggregation tests."""
