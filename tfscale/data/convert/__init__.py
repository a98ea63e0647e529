"""Conversion to TFRecord shards: `python -m tfscale.data.convert` is tfscale-convert (convert.py)."""
