"""Training data: corpora (text, the standard library, token files), tokenizers, batches."""
