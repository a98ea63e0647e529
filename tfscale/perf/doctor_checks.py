"""The names of tfscale-doctor's checks and the form of their results, without TensorFlow: tools/make_sbatch.py
validates --doctor with them before every job, and importing tfscale.perf.doctor would cost it TensorFlow's
import (~3 s)."""

import dataclasses

CHECK_NAMES = ("gpus", "driver", "memory-growth", "all-reduce", "horovod", "xla-step", "float16-step", "dali",
               "gpu-bandwidth", "throughput")  # in the order they run
SLOW_CHECKS = ("xla-step", "float16-step", "throughput")  # each compiles ResNet-50; --fast skips them

PASS, FAIL, NA = "pass", "fail", "n/a"


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS | FAIL | NA
    detail: str

    def line(self) -> str:
        return f"{self.status.upper():4}  {self.name:14} {self.detail}"
