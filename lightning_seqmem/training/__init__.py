"""The training side: ``CausalLM``, the token-weighted loss, attention selection and varlen arguments for packed
batches, the token-efficiency metric and the training-loop callbacks (final validation, progress bar)."""
