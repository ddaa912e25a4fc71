"""Experiment drivers, apart from the library: each is a command that launches training runs and
writes a report (``python -m pinads_rec.experiments.scaling|ablate|stability``).

The library (``pinads_rec`` minus this package) never imports from here; benchmarks and tests may.
"""
