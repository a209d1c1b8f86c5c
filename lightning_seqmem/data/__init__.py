"""Documents and their tokens: dataset sources and file reads, the built-in corpus and tokenizer, the tokenize-once
cache, and numpy views of the Arrow token columns (``tokens``). Nothing here knows about batches."""
