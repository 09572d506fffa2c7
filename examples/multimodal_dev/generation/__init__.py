"""Generating from the training model: cached decoding (``context.py``) and ``generate`` (``decode.py``)."""
