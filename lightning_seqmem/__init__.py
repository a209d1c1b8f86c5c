"""lightning_seqmem: less padding, less memory and no CUDA out-of-memory surprises for Lightning LM training.

Each subsystem adds its exports below (one block per module), so the package layout shows the architecture.
"""

__version__ = "0.1.0"
__all__: list[str] = []

# Each block below is owned by one module. Keep the imports light: none of them may import torch.cuda state.
