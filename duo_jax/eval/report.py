"""Writers shared by the evaluations and the benchmarks: Markdown tables, JSON files, heat maps and plots.

Figures are drawn with matplotlib's object API on an Agg canvas (no pyplot state, no display needed).
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# --- tables --------------------------------------------------------------------------------------------


def format_cell(value: Any) -> str:
    """A table cell: floats with 4 significant digits, NaN/None as '-', everything else via str()."""
    if value is None:
        return "-"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value):
            return "-"
        return f"{value:.4g}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table with left-aligned columns padded to a common width (readable as plain text too)."""
    cells = [[str(h) for h in headers]] + [[format_cell(v) for v in row] for row in rows]
    if any(len(row) != len(headers) for row in cells):
        raise ValueError(f"every row needs {len(headers)} cells")
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"

    return "\n".join(
        [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(row) for row in cells[1:]]
    )


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# --- JSON ---------------------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, (np.bool_,)):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None  # JSON has no NaN / inf
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write `data` as indented JSON (numpy scalars and arrays converted, NaN/inf as null); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(data), indent=2) + "\n")
    return path


def machine_info() -> dict:
    """Where a result was measured: host, CPU count, JAX version and backend, the device (and torch's version
    and threads when something loaded it). XLA_FLAGS is recorded when set."""
    import jax

    device = jax.devices()[0]
    info = dict(
        platform=platform.platform(),
        python=platform.python_version(),
        cpu_count=os.cpu_count(),
        processor=platform.processor() or platform.machine(),
        jax=jax.__version__,
        backend=jax.default_backend(),
        device=getattr(device, "device_kind", str(device)),
    )
    if os.environ.get("XLA_FLAGS"):
        info["xla_flags"] = os.environ["XLA_FLAGS"]
    torch = sys.modules.get("torch")  # reported when a peer loaded it, never imported for this
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    return info


def describe_machine(info: Mapping[str, Any]) -> str:
    """One line for a table caption, e.g. '2-core x86_64, JAX 0.10.2 on cpu (cpu), torch 2.13.0 (2 threads)'."""
    text = f"{info['cpu_count']}-core {info['processor']}, JAX {info['jax']} on {info['backend']} ({info['device']})"
    if "xla_cpu_multi_thread_eigen=false" in info.get("xla_flags", ""):
        text += " single-threaded"
    if "torch" in info:
        text += f", torch {info['torch']} ({info['torch_threads']} threads)"
    return text


# --- figures ------------------------------------------------------------------------------------------


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100, bbox_inches="tight")
    return path


def _draw_grid(
    axes, scores: np.ndarray, lengths: Sequence[int], depths: Sequence[float], title: str, ylabel: bool = True
):
    """One depth x length heat map on `axes`: score 1 green, 0 red (as DuoAttention's Fig. 5), each cell's
    score written in it when the grid is small enough to read."""
    scores = np.asarray(scores, float)
    image = axes.imshow(scores, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    if scores.size <= 150:
        for (i, j), value in np.ndenumerate(scores):
            if np.isfinite(value):
                axes.text(j, i, f"{value:.2g}", ha="center", va="center", fontsize=8)
    axes.set_xticks(range(len(lengths)), [_short_length(n) for n in lengths])
    axes.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
    axes.set_xlabel("context length (tokens)")
    if ylabel:
        axes.set_ylabel("needle depth")
    axes.set_title(title)
    return image


def _short_length(n: int) -> str:
    return f"{n / 1024:g}k" if n >= 1024 and n % 128 == 0 else str(n)


def grid_heatmap(
    path: str | os.PathLike, scores: np.ndarray, lengths: Sequence[int], depths: Sequence[float], title: str
) -> Path:
    """A NIAH heat map: `scores` [depths, lengths] in [0, 1] (NaN for a cell not run) -> PNG at `path`."""
    figure = _figure(2.0 + 0.9 * len(lengths), 1.5 + 0.45 * len(depths))
    image = _draw_grid(figure.add_subplot(), scores, lengths, depths, title)
    figure.colorbar(image, label="score")
    return _save(figure, path)


def grid_heatmaps(
    path: str | os.PathLike,
    scores: Mapping[str, np.ndarray],
    lengths: Sequence[int],
    depths: Sequence[float],
    titles: Mapping[str, str] | None = None,
    columns: int | None = None,
) -> Path:
    """The heat maps of several modes side by side (one panel each, one shared colour bar), wrapped into
    rows of `columns` panels (default: one row)."""
    titles = titles or {}
    columns = min(columns or len(scores), len(scores))
    rows = -(-len(scores) // columns)
    figure = _figure(1.0 + (1.2 + 0.9 * len(lengths)) * columns, (1.5 + 0.45 * len(depths)) * rows)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    image = None
    for i, (ax, (name, matrix)) in enumerate(zip(axes, scores.items())):
        image = _draw_grid(ax, matrix, lengths, depths, titles.get(name, name), ylabel=i % columns == 0)
    for ax in axes[len(scores) :]:
        ax.set_axis_off()
    figure.colorbar(image, ax=list(axes), label="score")
    return _save(figure, path)


def line_plot(
    path: str | os.PathLike,
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
    logy: bool = False,
    xticklabels: Sequence[str] | None = None,
) -> Path:
    """One line with markers per series over a shared x axis."""
    figure = _figure(6.4, 4.0)
    axes = figure.add_subplot()
    for name, ys in series.items():
        axes.plot(list(x), [np.nan if y is None else y for y in ys], marker="o", label=name)
    if logx:
        axes.set_xscale("log", base=2)
    if logy:
        axes.set_yscale("log")
    if xticklabels is not None:
        axes.set_xticks(list(x), list(xticklabels))
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    return _save(figure, path)


def budget_panels(
    path: str | os.PathLike,
    budgets: Sequence[float],
    panels: Mapping[str, tuple[Mapping[str, Sequence[float]], Mapping[str, float]]],
    *,
    title: str,
    columns: int = 4,
) -> Path:
    """Score against KV budget, one panel per entry of `panels` ({panel: (series, levels)}): each series a line
    over `budgets` (fractions, drawn as percents; or token counts, all > 1, drawn on a log axis), each level (a
    mode without a budget, e.g. full attention) a dashed horizontal line."""
    columns = max(1, min(columns, len(panels)))
    rows = -(-len(panels) // columns)
    figure = _figure(max(4.8, 3.2 * columns), 2.8 * rows + 0.4)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    tokens = bool(budgets) and min(budgets) > 1
    x = list(budgets) if tokens else [100 * b for b in budgets]
    for ax, (name, (series, levels)) in zip(axes, panels.items()):
        for label, value in levels.items():
            if value is not None and np.isfinite(value):
                ax.axhline(value, linestyle="--", color="black", linewidth=1, label=label)
        for label, ys in series.items():
            ax.plot(x, [np.nan if y is None else y for y in ys], marker="o", label=label)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("KV budget (tokens per KV head)" if tokens else "KV budget (%)", fontsize=8)
        if tokens and len(x) > 1:
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    for ax in axes[len(panels) :]:
        ax.set_axis_off()
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    return _save(figure, path)
