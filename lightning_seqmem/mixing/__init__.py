"""Several sources mixed by weight, decided before packing: the ``Mix`` request (``spec.py``), the interleaved order
that holds every source's share at every step (``interleave.py``) and the training sampler over it (``sampler.py``).
No Lightning import; ``Mix`` is also exported from the top of the package."""
