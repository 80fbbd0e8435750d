"""Find where two runs part: the first differing op, named by module and source line.

``locate_divergence(fn)`` runs ``fn`` twice in fresh ``deterministic``
blocks while recording every ATen op (name, module path, source line, a
bit-exact digest of its outputs) and returns the first op that differs as a
:class:`Divergence`, or ``None``. ``detctx run --locate`` does the same
across processes through :mod:`detctx._locate.child`. Recording is opt-in:
nothing is installed until a recording starts.
"""

from __future__ import annotations

from detctx._locate.child import start_from_environment
from detctx._locate.divergence import Divergence, compare_traces
from detctx._locate.search import locate_divergence

__all__ = ["Divergence", "compare_traces", "locate_divergence", "start_from_environment"]
