"""Data: the planted-truth synthetic generator (synth) and the Parquet loader."""
