"""The command lines behind ``python -m workbench`` (``workbench/__main__.py`` dispatches to them): ``check``
(the conformance suite on a kernel), ``generate`` (SmolLM2-135M through the paged cache), ``sim`` (the serving
simulator's commands), ``sweep`` (a panel's sweep over a grid), ``whatif`` (a serving what-if, a table out) and
``profile`` (the benchmarks a what-if's GPU profile is made from). Each module holds its parser and ``main(argv)``;
the work is done by the package it drives. ``bench`` keeps its own (``workbench.bench.command``), ``capture`` is
``workbench.model.capture``; the argument types every command shares are ``workbench.core.argtypes``.

Nothing is imported here.
"""
