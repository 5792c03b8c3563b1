"""One study per notebook panel, which the panel and its sweep share: parameters, a pure point, the figure.

    from workbench.studies import quant
    quant.QUANT.point(**quant.QUANT.defaults())     # one row, as `python -m workbench sweep quant` computes it
    quant_panel()                                   # workbench.ui.quant_panels: controls from QUANT.params

The sweep command finds them by name in ``workbench.sweeps.catalog``.
"""

from workbench.studies.base import Column, Param, Study

__all__ = ["Column", "Param", "Study"]
