"""Checkpoints: DCP save / load, resume rules, Hugging Face conversion."""
