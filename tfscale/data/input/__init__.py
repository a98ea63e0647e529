"""Training and eval input: loaders.py chooses tf.data (pipeline.py) or DALI (dali.py) for a run."""
