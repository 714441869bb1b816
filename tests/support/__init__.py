"""What the tests share, importable as ``support.*`` from any folder of ``tests/``
(``tests/conftest.py`` puts ``tests/`` on ``sys.path``): stand-in models and tokenizers
(:mod:`support.fakes`), model configs (:mod:`support.configs`), the float64 references of the
kernels (:mod:`support.reference`, :mod:`support.fused_reference`, :mod:`support.key_codes`), and the
staging daemon (:mod:`support.rtd`). Test modules import from here, never from each other
(``tests/test_import_graph.py`` checks)."""
