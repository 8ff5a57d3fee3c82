"""The rollout domain: events, the pure state machine, samplers, invariants, restore,
projections, the async runtime, generation backends, the training-loop API and the CLI."""

# This folder is the package rolloutlog.controller (pyproject's package-dir). Imported as a bare
# `controller` (the repository root on sys.path, an IDE's auto-import) it would be a second copy
# of every module, whose classes and errors are not rolloutlog's: refuse it.
if __name__ == "controller":
    raise ImportError(
        "import rolloutlog.controller, not controller: this folder is installed as the package "
        "rolloutlog.controller, and a bare `controller` import would load a second copy of it",
        name=__name__,
    )
