"""quilt-bench: the benchmark harness of quilt-attn (development only, not part of the library).

``bench`` (inputs, reference check, timing, the recorded grid), ``sweeps`` and ``report`` (the evaluation of
``quilt-bench report``), ``layer`` (a DSA attention layer proxy) and ``indexer`` (its fused lightning-indexer
kernel), ``cli`` (``quilt-bench`` / ``python -m quilt_bench``). The named benchmark cases are
``benchmarks/run.py``.
"""
