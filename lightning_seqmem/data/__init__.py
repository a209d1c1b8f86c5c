"""Documents and their tokens: dataset sources and file reads, the built-in corpus and tokenizer, the tokenize-once
cache (all under one root, ``cache_dir``), and numpy views of the Arrow token columns (``tokens``). Nothing here
knows about batches."""
