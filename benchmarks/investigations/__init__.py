"""One-off investigations kept for the record (why gloo receives are posted three actions ahead; the cost of
posting a gloo send while both ranks compute).  Their figures are in ``benchmarks/README.md``."""
