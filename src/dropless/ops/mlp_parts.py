"""Small pieces shared by the two fused expert-MLP Functions (the activation's math is
in `activations.py`): a weight operand of one expert, and the row bounds of each expert."""

# n rows of one expert, E experts

from __future__ import annotations


def _wt(w, e, trans_w):
    """The [in, out] operand of expert e: w[e]^T for the nn.Linear layout, else w[e]."""
    return w[e].t() if trans_w else w[e]


def _bounds(counts):
    lo = 0
    for e, n in enumerate(counts):
        if n:
            yield e, lo, lo + n
        lo += n
