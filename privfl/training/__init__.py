"""Local training: the local loop (``local``), the stacked executor that trains many clients at once (``stacked``)
and FOLA's per-example Fisher (``fisher``)."""
