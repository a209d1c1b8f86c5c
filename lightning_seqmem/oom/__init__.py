"""Surviving a CUDA out-of-memory step by splitting the micro-batch (``CausalLM(on_oom="split")``, docs/oom.md).

``split``: the pure batch cuts (rows, pairs, tokens) and the test injector; ``runner``: the retry loop that runs the
parts and agrees across ranks; ``hooks``: the LightningModule mixin that wires it into ``training_step``; ``reduce``:
what the ranks do together around a split step (the window's gradient average, the agreements on every allocation
before a collective); ``fsdp``: what FSDP needs around the parts.
"""
