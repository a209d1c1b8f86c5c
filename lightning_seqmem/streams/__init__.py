"""The stream engine: a ``datasets`` stream read, tokenized and packed on the fly, its position a typed state.

Readers and their shards (``readers.py``), one reader's rows and its state (``rows.py``), saved readers dealt to
another number of readers (``regroup.py``), what has been read (``counts.py``), how a stream becomes its splits
(``splits.py``), what identifies it in a checkpoint (``identity.py``), the train loader that saves every rank's
position (``loader.py``), a stream's loaders (``reading.py``) and several streams mixed by weight (``mixed.py``).
No Lightning import: the DataModule (``datamodule/``) wires it to Lightning's hooks.
"""
