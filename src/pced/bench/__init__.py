"""``pced bench``: speed and storage measurements (the run, backends side by side, questions at once on
an engine that batches them, its report, the bandwidth
floor a decode step is held against, and random-weight models of real architectures)."""
