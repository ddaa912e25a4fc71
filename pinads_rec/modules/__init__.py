"""Model building blocks, one idea per module."""
