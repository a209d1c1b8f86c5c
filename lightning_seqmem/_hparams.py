"""Lightning's ``save_hyperparameters`` without the reference cycle it leaves behind.

Called without ``frame=``, Lightning keeps ``inspect.currentframe()`` in a local of its own frame: that frame then
refers to itself, and through the caller's frame to ``self``. The object is freed only when the cyclic collector
runs, not when its last name goes. A DataModule whose loader is read outside a Trainer (plain Python, a notebook)
then keeps its persistent loader workers alive until that collection. In this repository's test processes the
collection itself also stalled: the collector finalized the loader's queues before the iterator's ``__del__`` asked
the workers to stop, so the stop message was never sent, and each worker was waited for (5 s) and then killed (10 s
per DataModule with two workers; a plain script showed only the late release). Handing Lightning the caller's frame
leaves no cycle. A Trainer drops its loaders' iterators when ``fit`` ends, so runs inside one were not slowed.
"""

from __future__ import annotations

import inspect
from typing import Any


def save_hyperparameters(obj: Any, *args: Any, **kwargs: Any) -> None:
    """``obj.save_hyperparameters(*args, **kwargs)`` as called from ``obj.__init__`` (this function's caller)."""
    obj.save_hyperparameters(*args, frame=inspect.currentframe().f_back, **kwargs)
