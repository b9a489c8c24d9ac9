"""MLflow and the sweep's other trackers: the run directory's tracking store, the one background writer, the
per-trial logger, the trial record's writer, and rebuilding the journal and MLflow runs from that record."""
