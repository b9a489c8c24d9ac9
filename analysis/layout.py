"""Layout facts of a drawn figure, saved beside its PNG (``fig_x.png.json``) so tests can check every figure the
report wrote: the axes' share of the canvas, the legends' boxes against the canvas, the labelled series.

A figure is well laid out when its axes cover a fair share of the canvas (a squeezed plot has a tiny share),
every legend lies inside the canvas (a clipped legend does not) and does not sit over an axes' data area
unless it was placed inside that axes on purpose (``loc`` inside), and every series has a legend entry.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

from matplotlib.figure import Figure

__all__ = ["layout_of", "save_png", "problems", "fit_legend"]

MIN_AXES_FRACTION = 0.35  # of the canvas area covered by the (non-colorbar, non-twin) axes


def _box(b) -> list[float]:
    return [float(b.x0), float(b.y0), float(b.x1), float(b.y1)]


def _titles(fig: Figure, axes) -> list:
    out = [a.title for a in axes]
    return out + ([fig._suptitle] if getattr(fig, "_suptitle", None) is not None else [])


def _overlap(a: list[float], b: list[float]) -> bool:
    return min(a[2], b[2]) - max(a[0], b[0]) > 1 and min(a[3], b[3]) - max(a[1], b[1]) > 1


def layout_of(fig: Figure) -> dict:
    """Canvas size (px), axes boxes, legend boxes and labels (display px, origin bottom left)."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    W, H = fig.bbox.width, fig.bbox.height
    axes = [a for a in fig.axes if a.get_label() != "<colorbar>"]
    seen, main = set(), []
    for a in axes:  # twinx axes share the main axes' position: count the area once
        key = tuple(round(v, 1) for v in _box(a.bbox))
        if key not in seen:
            seen.add(key)
            main.append(a)
    legends = [*fig.legends, *(a.get_legend() for a in axes if a.get_legend() is not None)]
    return {
        "width": float(W), "height": float(H),
        "axes": [_box(a.bbox) for a in main],
        "axes_fraction": sum(a.bbox.width * a.bbox.height for a in main) / (W * H),
        "legends": [{"box": _box(lg.get_window_extent(r)),
                     "labels": [t.get_text() for t in lg.get_texts()],
                     "in_axes": lg in [a.get_legend() for a in axes]} for lg in legends],
        "titles": [_box(t.get_window_extent(r)) for t in _titles(fig, main) if t.get_text()],
        "tight": _box(fig.get_tightbbox(r).transformed(fig.dpi_scale_trans)),
    }


def problems(lay: dict) -> list[str]:
    """What is wrong with a layout (empty = fine)."""
    out = []
    if lay["axes_fraction"] < MIN_AXES_FRACTION:
        out.append(f"axes cover {lay['axes_fraction']:.2f} of the canvas (< {MIN_AXES_FRACTION})")
    W, H = lay["width"], lay["height"]
    for lg in lay["legends"]:
        x0, y0, x1, y1 = lg["box"]
        if x0 < -1 or y0 < -1 or x1 > W + 1 or y1 > H + 1:
            out.append(f"legend {lg['labels'][:2]}… outside the canvas {lg['box']} vs {W}x{H}")
        if lg["in_axes"]:
            out.append(f"legend {lg['labels'][:2]}… inside an axes (over the data): put it outside")
        clash = [b for b in lay["titles"] + ([] if lg["in_axes"] else lay["axes"]) if _overlap(lg["box"], b)]
        if clash:
            out.append(f"legend {lg['labels'][:2]}… overlaps a title or the data area {clash[0]}")
    x0, y0, x1, y1 = lay["tight"]  # everything drawn (labels, titles) inside the canvas
    if x0 < -1 or y0 < -1 or x1 > W + 1 or y1 > H + 1:
        out.append(f"drawn content {lay['tight']} exceeds the canvas {W}x{H} (clipped labels)")
    return out


def save_png(fig: Figure, path: Path | None = None) -> bytes:
    """PNG bytes; with ``path``, also ``path`` and its layout sidecar ``path.json``."""
    lay = layout_of(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    data = buf.getvalue()
    if path is not None:
        Path(path).write_bytes(data)
        Path(str(path) + ".json").write_text(json.dumps(lay, indent=1), encoding="utf-8")
    return data


def fit_legend(fig: Figure, handles: list, labels: list[str], max_cols: int = 5, **kw):
    """A figure legend below the axes with as many columns as fit inside the canvas width."""
    for ncols in range(min(max_cols, len(labels)), 0, -1):
        lg = fig.legend(handles, labels, loc="outside lower center", ncols=ncols, **kw)
        fig.canvas.draw()
        box = lg.get_window_extent(fig.canvas.get_renderer())
        if ncols == 1 or (box.x0 >= 0 and box.x1 <= fig.bbox.width):
            return lg
        lg.remove()
    return None
