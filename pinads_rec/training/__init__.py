"""Training: sharded checkpoints (``checkpoint.py``)."""
