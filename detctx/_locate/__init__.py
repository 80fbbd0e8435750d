"""Find where two runs part: the first differing op, named by module and source line.

``locate_divergence(fn)`` runs ``fn`` twice in fresh ``deterministic``
blocks while recording every ATen op (name, module path, source line, a
bit-exact digest of its outputs) and returns the first op that differs as a
:class:`Divergence`, or ``None``. ``detctx run --locate`` does the same
across processes through :mod:`detctx._locate.child`. Recording is opt-in:
nothing is installed until a recording starts.
"""

from __future__ import annotations

from detctx._locate.callsite import UNKNOWN, keep_for_backward, user_line, user_line_in_backward
from detctx._locate.child import record_until_exit, start_from_environment
from detctx._locate.digest import NUMPY_DTYPES, ROW_BYTES, SMALL, STAGED
from detctx._locate.digest import digest as tensor_digest
from detctx._locate.divergence import Divergence, compare_traces
from detctx._locate.eager import COMPILE_OFF
from detctx._locate.keys import PUBLIC_KEY, DigestKey
from detctx._locate.modules import ModuleTracker
from detctx._locate.ops import op_info
from detctx._locate.outputs import combine_digests, new_values, tensors
from detctx._locate.recorder import Recorder, dispatch_mode
from detctx._locate.search import locate_divergence
from detctx._locate.staging import Staging, stacked_digests

# Besides locate's own API, the machinery detctx._compare records with: the running
# module's path, the user's source line, what each op is, and the digest (under the
# public key: its recordings are compared across processes that share no key), one
# tensor at a time or many small ones at once.
__all__ = [
    "COMPILE_OFF",
    "NUMPY_DTYPES",
    "PUBLIC_KEY",
    "ROW_BYTES",
    "SMALL",
    "STAGED",
    "UNKNOWN",
    "DigestKey",
    "Divergence",
    "ModuleTracker",
    "Recorder",
    "Staging",
    "combine_digests",
    "compare_traces",
    "dispatch_mode",
    "keep_for_backward",
    "locate_divergence",
    "new_values",
    "op_info",
    "record_until_exit",
    "stacked_digests",
    "start_from_environment",
    "tensor_digest",
    "tensors",
    "user_line",
    "user_line_in_backward",
]
