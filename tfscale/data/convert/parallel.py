"""Worker processes and progress bars of the conversion tool (scan and write run the same way).

Every helper takes `pool=None` to mean "inline, in this process": num_workers=1 runs, and tests,
need no process pool.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import sys
from typing import Callable, Iterable, Iterator

from tqdm import tqdm

from tfscale.cluster import devices


def default_num_workers() -> int:
    """CPUs this process may use (its affinity mask, capped by SLURM_CPUS_PER_TASK), not the whole node."""
    return devices.usable_cores()


def process_pool(num_workers: int, preload: Iterable[str]) -> concurrent.futures.ProcessPoolExecutor:
    """Workers forked from a server process that imported the `preload` modules once.

    Not plain fork: the caller may hold TensorFlow/BLAS threads whose locks a child would inherit
    mid-use. Not spawn: every worker would import TensorFlow again (~5 s each).
    """
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if "forkserver" in methods:
        context.set_forkserver_preload(list(preload))
    return concurrent.futures.ProcessPoolExecutor(max_workers=num_workers, mp_context=context)


def map_ordered(pool, fn: Callable, args: list, chunksize: int) -> Iterator:
    """fn(a) for a in args, in order: in worker processes, or inline when pool is None."""
    return pool.map(fn, args, chunksize=chunksize) if pool else map(fn, args)


def run_unordered(pool, fn: Callable, arg_tuples: list[tuple]) -> Iterator:
    """fn(*args) for each tuple, yielded as they finish; inline when pool is None."""
    if pool is None:
        yield from (fn(*args) for args in arg_tuples)
        return
    futures = [pool.submit(fn, *args) for args in arg_tuples]
    try:
        for future in concurrent.futures.as_completed(futures):
            yield future.result()
    finally:  # on an error, start no further shards; running ones finish or are killed with us
        for future in futures:
            future.cancel()


def progress(total_images: int, desc: str) -> tqdm:
    """A progress bar counting images, on stderr (stdout stays free for results)."""
    return tqdm(total=total_images, desc=desc, unit="img", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)
