"""docs/models-and-data.md#dataset-settings, the page a short split's error message points to, names every setting a
spec may give each registered image dataset, and no other, and quotes each dataset's default split sizes."""
from __future__ import annotations

import re
from pathlib import Path

from tasks.data import DATASETS
from tasks.data.images import ImageDataset
from tests.test_doc_links import _anchors

PAGE = Path(__file__).resolve().parents[2] / "docs" / "models-and-data.md"


def _table() -> dict[str, set[str]]:
    """dataset name -> the settings the page's table lists for it."""
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("### Dataset settings"):]
    section = section[: section.index("\n## ")]
    out: dict[str, set[str]] = {}
    for row in re.findall(r"^\| (`.*?) \| (.*?) \|", section, re.M):
        names = re.findall(r"`(\w+)`", row[0])
        datasets = re.findall(r"`(\w+)`", row[1]) if row[1] != "all" else list(DATASETS.names())
        for d in datasets:
            out.setdefault(d, set()).update(names)
    return out


def test_the_page_lists_every_setting_of_every_image_dataset():
    table = _table()
    images = {n: DATASETS.get(n) for n in DATASETS.names() if isinstance(DATASETS.get(n), ImageDataset)}
    assert len(images) == 6
    for name, ds in images.items():
        # a preset's fixed path is still a setting it takes: the table lists path under hf, presets use hf's rows
        documented = table.get(name, set()) | (table["hf"] if ds.kind == "hub" else set())
        assert documented == ds.allowed(sweep=True), name


def test_the_error_messages_anchor_exists_and_default_sizes_are_quoted():
    assert "dataset-settings" in _anchors(PAGE)
    text = PAGE.read_text(encoding="utf-8")
    for name in ("imagenet1k", "cifar10"):
        sizes = DATASETS.get(name).sizes
        assert " / ".join(f"{sizes[s]:,}" for s in ("train", "calibration", "selection", "evaluation")) in text
    small = DATASETS.get("imagefolder").sizes
    assert "{" + ", ".join(f"{k}: {v}" for k, v in small.items()) + "}" in text
