"""Each Horovod rank all-reduces large loss-scaled gradients as float16 (`horovod_fp16_allreduce`).

    python -m tfscale.launch --backend=horovod --num_workers=2 -- tests/helpers/horovod_fp16_sum.py OUT.json

Rank r contributes [40000, 40000 - 32 r, 0.001 (r + 1)]: each fits float16 (max 65504), their sum does
not. Rank 0 writes what tfscale's gradient all-reduce returns, the float32 average, and what Horovod's
own float16 average (`op=hvd.Average`: sum first, divide after) returns.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from tfscale.cluster import collectives  # noqa: E402
from tfscale.cluster import horovod_start


def main(out_path: str) -> None:
    hvd = horovod_start.import_horovod()
    hvd.init()
    rank = hvd.rank()
    grads = [tf.constant([40000.0, 40000.0 - 32 * rank]), tf.constant([1e-3 * (rank + 1)])]
    fp16 = collectives.HorovodCollectives(hvd, None, fp16_allreduce=True).reduce_gradients(grads)
    float32 = collectives.HorovodCollectives(hvd, None).reduce_gradients(grads)
    horovod_average = hvd.grouped_allreduce(grads, op=hvd.Average, compression=hvd.Compression.fp16)
    if rank == 0:
        as_lists = lambda tensors: [t.numpy().astype(float).tolist() for t in tensors]  # noqa: E731
        with open(out_path, "w") as f:
            json.dump({"size": hvd.size(), "fp16": as_lists(fp16), "float32": as_lists(float32),
                       "dtypes": [t.dtype.name for t in fp16], "horovod_average": as_lists(horovod_average)}, f)


if __name__ == "__main__":
    main(sys.argv[1])
