"""Privacy units and placements around non-private algorithms: the privacy wrapper (``wrapper``:
``register_algorithm``), the one DP-SGD engine (``record_level``), distributed noise and secure aggregation's
encodings (``secure``)."""
