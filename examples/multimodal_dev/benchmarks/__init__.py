"""Benchmarks: ``python -m examples.multimodal_dev.benchmarks.NAME``; each prints a ratio against a
peer measured in the same run. Nothing in the package imports them."""
