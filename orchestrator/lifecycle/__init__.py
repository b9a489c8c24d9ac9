"""What happens to a sweep after it ran: resume (its run directory checked and prepared), refine, widen, and
``healsweep doctor``. Siblings: each calls the sweep (``orchestrator.sweep.run.run_sweep``); none imports
another but ``continuation.py``, what refine and widen share."""
