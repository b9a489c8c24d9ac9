"""healsweep's orchestrator: a sweep spec in, trials on Ray Tune with a per-cell search, MLflow records out.

Sub-packages by concern (docs/layout.md): ``spec`` (the validated spec and its plan), ``search`` (what each cell
heals), ``rundir`` (a run directory's files, faults, signals), ``raytune`` (Ray and Tune), ``tracking`` (MLflow and
the trial record), ``sweep`` (its typed state and ordered stages), ``lifecycle`` (resume, refine, widen, doctor),
``commands`` and ``cli`` (the command line), ``bundle`` (offline installs). The layers are an import-linter
contract (pyproject.toml).

``HEAVY``: the libraries this package may import inside a function, where the work that needs them starts (the
command line, ``healsweep validate`` and a run directory's checks stay light). Every other import sits at the top
of its file; tests/test_imports.py holds both.
"""

HEAVY = ("ray", "mlflow", "optuna", "torch", "torchvision", "timm", "scipy", "pandas", "matplotlib", "pyarrow",
         "datasets", "sqlalchemy", "safetensors", "numpy", "huggingface_hub", "yaml", "tqdm")
