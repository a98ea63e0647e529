"""Staging shards to node-local disk: `python -m tfscale.data.stage` is tfscale-stage (stage.py)."""
