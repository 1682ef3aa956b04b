"""Front ends: the ``privfl`` command line (``cli``), ``privfl compare`` (``compare``), ``privfl.federate`` (``api``),
plots and empirical audits. They parse, resolve settings, call the runtime and print."""
