"""matplotlib, which draws the PNGs of ``pathways trace --plot``, ``pathways plan --plot`` and
the benchmarks. It comes with an extra (``pip install "pathways[plots]"``) and is imported
only when a plot is drawn, so that the runtime installs without it."""

from __future__ import annotations

from types import ModuleType

INSTALL = 'pip install "pathways[plots]" (or matplotlib)'


def pyplot() -> ModuleType:
    """``matplotlib.pyplot``, drawing to files (the Agg backend); ImportError saying how to
    install matplotlib where it is not."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"drawing a plot needs matplotlib, which is not installed: {INSTALL}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
