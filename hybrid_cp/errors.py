"""Typed errors of hybrid-cp.

Every error the package raises on purpose is a `CPError`, so a training script can tell "hybrid-cp
refused this call" from a bug elsewhere. Each class also derives from the builtin exception the
package raised before these classes existed (ValueError, TypeError or RuntimeError), so existing
`except ValueError:` clauses keep working. Messages name the argument, the value seen and the fix.

The catalogue with a minimal example per error is docs/errors.md; tests/test_errors.py runs
every example in it and fails if a class below has none.
"""

from __future__ import annotations


class CPError(Exception):
    """Base class of every error hybrid-cp raises on purpose."""


class ConfigError(CPError, ValueError):
    """A setting is invalid: mesh degrees, layout, backend, window, seq_len, cu_seqlens, options."""


class ShapeError(CPError, ValueError):
    """A tensor has the wrong shape (rank, batch, length, heads, head_dim, stride) for the call."""


class InputTypeError(CPError, TypeError):
    """An argument has the wrong Python type or a tensor the wrong dtype."""


class InconsistentRanksError(CPError, ValueError):
    """The ranks of one cp group were called with different arguments, or some rank rejected
    its own arguments; raised on every rank (instead of hanging in the next collective)."""


class SetupError(CPError, RuntimeError):
    """The process is not set up for the call (no process group, a model not prepared for CP)."""


class CommTimeoutError(CPError, RuntimeError):
    """A collective did not complete within the process group's timeout: a peer rank died, hung,
    or raised on its own. The message names the collective and the timeout in effect."""


class NonFiniteError(CPError, ValueError):
    """validate="debug" only: NaN or inf in a rank's q, k or v (the message names rank and tensor)."""


__all__ = [
    "CPError",
    "ConfigError",
    "ShapeError",
    "InputTypeError",
    "InconsistentRanksError",
    "SetupError",
    "CommTimeoutError",
    "NonFiniteError",
]
