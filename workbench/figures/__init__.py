"""Plotly figures, built from the plain data of the package's pure functions: one module per notebook group, as
``workbench.studies``. A study's ``draw`` and the ui panels use them; they need plotly, which the core does not.
"""
