"""``pced bench``: speed and storage measurements (the run, backends side by side, questions at once on
an engine that batches them, its report, this machine's limits and the floors each time is held
against, and random-weight models of real architectures)."""
