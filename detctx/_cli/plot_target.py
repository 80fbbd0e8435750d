"""Where ``--plot`` writes: checked before any run starts, in the format its suffix names.

A run can take hours; a plot path that cannot be written must fail at once,
not after every run has finished. The suffix decides the format (``.png``,
``.pdf``, ``.svg``, whatever matplotlib writes); a suffix matplotlib does not
write, such as ``.txt``, is refused rather than filled with a PNG.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_plot_path", "plot_format"]


def plot_format(path: str | Path) -> str:
    """The image format ``path``'s suffix names: ``"png"`` for ``loss.PNG``."""
    return Path(path).suffix[1:].lower()


def check_plot_path(path: Path) -> None:
    """Raise ``ValueError`` unless a plot can be written at ``path``.

    The suffix must name a format matplotlib writes and the folder must exist
    and be writable; an existing file is overwritten. Needs matplotlib
    (check it with :func:`~detctx._cli.plotting.load_pyplot` first).
    """
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    shown = ", ".join(f".{name}" for name in formats)
    if path.is_dir():
        raise ValueError(f"--plot {path} is a folder; name a file in it: {path / 'curves.png'}")
    fmt = plot_format(path)
    if fmt not in formats:
        problem = (
            f"matplotlib writes no {path.suffix!r} images"
            if path.suffix
            else "the name has no suffix, and the suffix says which image format to write"
        )
        raise ValueError(
            f"--plot {path}: {problem}; end the name with .png, .svg or .pdf "
            f"(every suffix matplotlib writes: {shown})"
        )
    folder = path.parent
    if not folder.is_dir():
        raise ValueError(f"--plot {path}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--plot {path}: no permission to write there; choose another path")
