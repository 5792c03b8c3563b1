"""The command lines behind ``python -m workbench`` (``workbench/__main__.py`` dispatches to them): ``check``
(the conformance suite on a kernel), ``generate`` (SmolLM2-135M through the paged cache), ``sim`` (the serving
simulator's commands) and ``sweep`` (a panel's sweep over a grid). Each module holds its parser and ``main(argv)``;
the work is done by the package it drives. ``bench`` keeps its own (``workbench.bench.command``), ``capture`` is
``workbench.model.capture``; the argument types every command shares are ``workbench.core.argtypes``.

Nothing is imported here.
"""
