"""Worker entry points launched by h3lab.launch under torchrun (one module per kind of job)."""
