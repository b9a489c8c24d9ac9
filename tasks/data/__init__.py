"""Data: the four disjoint splits and the registered datasets (``DATASETS``).

Implementations register themselves on import; this package face imports every one of them, so
``from tasks.data import load_dataset`` sees the full registry (timm's pattern: registry in a leaf module).
"""
from tasks.data import digits, images  # noqa: F401 - register 'digits', image folders/tables, HF datasets
from tasks.data.digits import DIGITS_SPLIT_SIZES, DIGITS_TRANSFORM, digits_preprocess, load_digits
from tasks.data.splits import (DATASETS, SPLITS, DatasetError, DatasetSplits, SplitData, load_dataset, redraw_calibration,
                               split_indices)

__all__ = ["DATASETS", "SPLITS", "DatasetError", "DatasetSplits", "SplitData", "load_dataset", "redraw_calibration",
           "split_indices", "DIGITS_SPLIT_SIZES",
           "DIGITS_TRANSFORM", "digits_preprocess", "load_digits"]
