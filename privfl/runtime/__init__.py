"""The round engine (``engine``: :class:`privfl.runtime.engine.Simulation` and its multi-phase form) and what every
runtime shares about multi-phase runs (``phases``, ``phase_ledgers``)."""
