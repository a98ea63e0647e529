"""Data, in three wings, each importing only what lies below it (tests/test_layers.py):

  convert/  images, IDX or CIFAR files -> TFRecord shards + manifest + DALI indexes (tfscale-convert)
  stage/    shards -> node-local disk before a run, each node only what its workers read (tfscale-stage)
  input/    shards (or TFDS, or synthetic data) -> per-worker training and eval batches: tf.data or
            DALI, chosen by input/loaders.py
"""
