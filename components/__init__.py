"""TorchX components for pinads_rec.

TorchX loads a component from its file path, from the repository root::

    torchx run components/train.py:train -j 1x2 --config configs/demo.yaml

This package marker only lets tests and tools import them as ``components.train``; TorchX itself
does not need it. See docs/launching.md.
"""
