"""Register the starter kernel with each of its three deliberate bugs (``workbench/conformance/starter.py``) as
``broken_mask``, ``broken_gqa`` and ``broken_block``, to show the conformance suite catching them:

    python -m workbench check broken_gqa --load scripts/broken_starters.py
"""

import functools

from workbench import conformance
from workbench.conformance.starter import MISTAKES, starter_decode

for mistake in MISTAKES:
    if mistake != "none":
        conformance.register("decode", f"broken_{mistake}", functools.partial(starter_decode, mistake=mistake),
                             layouts=("nhd", "hnd"), description=f"the starter kernel with its {mistake!r} bug")
