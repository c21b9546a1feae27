"""Capture backends: ``te`` (Transformer Engine adapter), ``torch`` (ordered ``torch.cuda.CUDAGraph``),
``emulate`` (CPU static-buffer emulation); ``common`` holds what torch and emulate share."""
