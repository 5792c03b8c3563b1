"""Lossless coding of K/V bytes, below every feature that stores them: ``delta`` (delta between neighbouring tokens,
byte planes, run lengths, zstd; the codec and its entropy bounds) and ``delta_options`` (what it takes and the checks
that refuse the rest). Used by the compression studies (``workbench.compress``: the ratios, the lossy variant
``delta_quant``) and by the disk tier (``workbench.tiers.disk_coding``). Nothing is imported here."""
