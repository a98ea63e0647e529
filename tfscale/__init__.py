"""tfscale: distributed training of Keras 3 ResNet image classifiers with tf.distribute or Horovod."""

__version__ = "0.1.0"
