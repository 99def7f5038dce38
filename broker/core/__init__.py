"""The bottom layer: errors, JSON safety, encodings, protocol constants, metrics.

Everything else may import from here; nothing here imports from any other broker package
(docs/architecture.md, enforced by tests/unit/test_layers.py).
"""
