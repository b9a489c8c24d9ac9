"""Pure compute: data, models, pruning, healing, the target store, one trial. No Ray, no MLflow.

``HEAVY``: the libraries a module here may import inside a function (where the work that needs them starts);
every other import sits at the top of its file (tests/test_imports.py).
"""

HEAVY = ("torch", "torchvision", "timm", "scipy", "pandas", "pyarrow", "datasets", "safetensors", "numpy",
         "sklearn", "huggingface_hub", "PIL", "matplotlib", "tqdm")
