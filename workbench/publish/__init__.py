"""What the notebooks publish: ``notebook`` (their ``SMOKE`` sizes, plain-text summaries and the key numbers each
concludes with; no plotly), ``page`` (an executed notebook as one HTML page that draws its charts offline: the tour's
report) and ``site`` (the series as a static site, ``python -m workbench report``).

Nothing is imported here.
"""
