"""The errors the runtime raises while training, so that every layer above can name and catch them."""
from __future__ import annotations


class CollectiveError(RuntimeError):
    """A collective failed or timed out (for example because a peer rank died)."""


class CollectiveMismatchError(RuntimeError):
    """Ranks were about to issue different collectives (different unit, size, dtype or kind)."""


class NonFiniteGradientError(RuntimeError):
    """A gradient (or the total gradient norm) holds NaN/Inf; the message names units and ranks."""
