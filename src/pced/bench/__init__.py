"""``pced bench``: speed and storage measurements (the run, its vLLM lane, its report, the bandwidth
floor a decode step is held against, and random-weight models of real architectures)."""
