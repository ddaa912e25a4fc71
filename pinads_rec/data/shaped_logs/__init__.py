"""Raw logs in the exact layouts of the public datasets ``configs/datasets/`` reads, each from a
planted-truth world of its own, with the true probabilities kept aside (``truth.csv``): data the
project's model was not designed on, to measure it against the oracle and a simple reference
(``benchmarks/datasets.py``; docs/datasets.md).

``python -m pinads_rec.data.shaped_logs taobao --out RAW [--users N] [--seed S]`` (or ``kuairand``).
"""
