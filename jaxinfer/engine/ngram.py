"""N-gram (prompt lookup) proposals: the tokens that followed the sequence's last n tokens where those n tokens
occurred before, in its prompt or its output (pure NumPy, no JAX).

Why on the host: the host holds every sequence's tokens and plans each step anyway (DESIGN.md: speculative
proposals are host-side plans that become arrays of the same step), and the lookup is a few vectorised
compares over one sequence's history, tens of microseconds for thousands of tokens. On device it would need
each sequence's whole history uploaded, or kept and updated there, for the same answer.

The longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min) that occurs earlier wins; among its
earlier occurrences the most recent one, whose continuation is the most likely to be repeated next (code
edits and quotes copy what was just read). A proposal may be shorter than k when the match ends near the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int,
                  window: int | None = None) -> list[int]:
    """Up to `k` proposed tokens continuing `tokens`, or [] when no suffix n-gram (min_n <= n <= max_n)
    occurred before. `window`: only the last `window` tokens are searched (bounds the cost of long contexts)."""
    ids = np.asarray(tokens, np.int64)
    if window is not None and ids.size > window:
        ids = ids[-window:]
    total = ids.size
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # Windows that start at i < total - n and are followed by at least one token: ids[:total - 1].
        windows = sliding_window_view(ids[: total - 1], n)  # [total - n, n]
        hits = np.flatnonzero((windows == ids[total - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + k].tolist()
    return []
