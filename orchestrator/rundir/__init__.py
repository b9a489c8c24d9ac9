"""A run directory's own files and how a sweep stops so that it stays resumable: ``sweep.json``, the Optuna
journal and the driver lock (``files.py``), the trial record ``trials.jsonl`` (``records.py``), faults at the
edges (``faults.py``) and signals (``interrupt.py``). The lowest layer of the orchestrator but spec/search."""
