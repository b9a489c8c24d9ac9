"""The sweep: its typed state (``state.py``) and its ordered stages (``run.py``: models -> dense targets ->
diagnostics -> masks -> trials -> MLflow -> report). Lifecycle commands (resume, refine, widen) call
``run_sweep``; nothing here imports them."""
