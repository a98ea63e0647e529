"""A Slurm task's cluster, from its environment: host lists, tasks per node, ports, a TF_CONFIG.

Part of `tfscale.cluster.distribute` (which re-exports these names and is the only module that imports this
one), kept apart because it is plain text processing: no TensorFlow, testable against
`scontrol show hostnames` and real `srun` environments.
"""

from __future__ import annotations

import re


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list -> host names, in Slurm's order (what `scontrol show hostnames` prints).

    'gpu[01-03,07],login1' -> gpu01 gpu02 gpu03 gpu07 login1; several bracket groups multiply, the
    first varying slowest: 'rack[1-2]-n[01-02]' -> rack1-n01 rack1-n02 rack2-n01 rack2-n02. Slurm
    (hostlist.c) rejects text after the last group ('nid[1-2]-ib'); it is accepted here as a suffix.
    """
    hosts = []
    for pattern in _split_outside_brackets(hostlist, hostlist):
        hosts += _expand_host_pattern(pattern, hostlist)
    return hosts


def _split_outside_brackets(text: str, hostlist: str) -> list[str]:
    """Splits at commas/whitespace that are not inside [...]: 'a[1,3],b' -> 'a[1,3]', 'b'."""
    parts, current, depth = [], "", 0
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"host list {hostlist!r}: unbalanced or nested brackets")
        if depth == 0 and (char == "," or char.isspace()):
            parts.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ValueError(f"host list {hostlist!r}: '[' without ']'")
    return [p for p in parts + [current] if p]


def _expand_host_pattern(pattern: str, hostlist: str) -> list[str]:
    """One comma-free pattern, e.g. 'rack[1-2]-n[01,03]', expanded group by group (first group outermost)."""
    match = re.search(r"\[([^\[\]]*)\]", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end():]
    rests = _expand_host_pattern(tail, hostlist)
    return [f"{head}{number}{rest}" for number in _expand_ranges(match.group(1), hostlist) for rest in rests]


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    """'01-03,07' -> 01 02 03 07: each range keeps the zero padding of its first number, as Slurm does."""
    numbers = []
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or not (last or first).isdigit() or int(last or first) < int(first):
            raise ValueError(f"host list {hostlist!r}: {part!r} is not a range like 3 or 01-04")
        width = len(first)  # zero padding is part of the name: [01-03] -> 01, 02, 03
        numbers += [f"{n:0{width}d}" for n in range(int(first), int(last or first) + 1)]
    return numbers


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE '2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for part in tasks_per_node.split(","):
        count, _, repeat = part.partition("(x")
        if not count.isdigit() or not (repeat.rstrip(")") or "1").isdigit():
            raise ValueError(f"tasks per node {tasks_per_node!r}: {part!r} is not like 2 or 2(x3)")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return counts


# A Slurm task's view of the cluster it belongs to, step-level variables first. srun sets the
# SLURM_STEP_* ones for the tasks it starts; the job-level ones describe the whole allocation, which
# an `srun -n 2` inside a 4-task allocation uses only part of (TensorFlow's SlurmClusterResolver
# reads the step's too). The job-level ones remain for steps started by other means.
# SLURM_PROCID and SLURM_LOCALID are already per step: the rank within the step, and among the
# step's tasks on this node.
_SLURM_NODELIST_KEYS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_SLURM_TASKS_PER_NODE_KEYS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
_SLURM_NUM_TASKS_KEYS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")

# Default MWMS ports of a Slurm step: a block of ports in 20000-39999 (tools/slurm_testbed.sh keeps
# its daemons above), one port per task on a node. The block depends on the job id AND the step id:
# two steps of one job running at once on a node (`srun -n 2 ... & srun -n 2 ... &`) would
# otherwise both bind base+0, base+1. Blocks are PORTS_PER_SLURM_STEP wide, so jobs with nearby ids
# (consecutive submissions, likely neighbours on a shared node) do not overlap either, as they did
# with a base of 20000 + job id: steps 0-3 of jobs whose ids differ by less than 625 get disjoint
# blocks. A step with more tasks on a node than a block holds spills into the next block; give such
# layouts an explicit distribute.port_base.
SLURM_PORT_RANGE = (20000, 40000)  # [first, end)
PORTS_PER_SLURM_STEP = 8  # tasks per node a block holds: one per GPU of an 8-GPU node
CONCURRENT_SLURM_STEPS = 4  # steps of one job that get disjoint blocks


def _first_present(env: dict, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(key, value) of the first of `keys` set in `env`, or None."""
    return next(((key, env[key]) for key in keys if key in env), None)


def slurm_num_tasks(env: dict) -> int:
    """Tasks of this Slurm step (SLURM_STEP_NUM_TASKS), else of the job (SLURM_NTASKS); 1 outside Slurm."""
    found = _first_present(env, _SLURM_NUM_TASKS_KEYS)
    return int(found[1]) if found else 1


def slurm_port_base(env: dict) -> int:
    """The first MWMS port of this Slurm step on every node (see SLURM_PORT_RANGE above for why)."""
    first, end = SLURM_PORT_RANGE
    num_blocks = (end - first) // PORTS_PER_SLURM_STEP
    job_id = int(env.get("SLURM_JOB_ID", "0"))
    step_id = int(env.get("SLURM_STEP_ID", "0"))
    block = (job_id * CONCURRENT_SLURM_STEPS + step_id % CONCURRENT_SLURM_STEPS) % num_blocks
    return first + block * PORTS_PER_SLURM_STEP


def slurm_tf_config(env: dict, port_base: int) -> dict:
    """A TF_CONFIG for this task's Slurm step, in Slurm's default block distribution (task i runs on the
    node holding slot i), or a ValueError naming the variables that disagree.

    Step-level variables are read before job-level ones (see _SLURM_NODELIST_KEYS). Worker j on a
    node listens on `port_base + j`; port_base 0 derives it from the job and step ids (`slurm_port_base`).
    """
    hosts_key, hostlist = _required_slurm_var(env, _SLURM_NODELIST_KEYS)
    counts_key, tasks_per_node = _required_slurm_var(env, _SLURM_TASKS_PER_NODE_KEYS)
    tasks_key, num_tasks = _required_slurm_var(env, _SLURM_NUM_TASKS_KEYS)
    _, proc_id = _required_slurm_var(env, ("SLURM_PROCID",))
    hosts, counts = expand_hostlist(hostlist), expand_tasks_per_node(tasks_per_node)
    if len(hosts) != len(counts):
        raise ValueError(f"{hosts_key}={hostlist} has {len(hosts)} hosts but {counts_key}={tasks_per_node} "
                         f"describes {len(counts)}")
    port_base = port_base or slurm_port_base(env)
    workers = [f"{host}:{port_base + local}" for host, count in zip(hosts, counts) for local in range(count)]
    if len(workers) != int(num_tasks):
        raise ValueError(f"{tasks_key}={num_tasks} but {hosts_key} / {counts_key} hold {len(workers)} task slots")
    if not 0 <= int(proc_id) < len(workers):
        raise ValueError(f"SLURM_PROCID={proc_id} is not a rank of the {len(workers)} tasks in {tasks_key}")
    return {"cluster": {"worker": workers}, "task": {"type": "worker", "index": int(proc_id)}}


def _required_slurm_var(env: dict, keys: tuple[str, ...]) -> tuple[str, str]:
    found = _first_present(env, keys)
    if found is None:
        raise ValueError(f"a Slurm task with SLURM_NTASKS/SLURM_STEP_NUM_TASKS > 1 but none of {', '.join(keys)} "
                         "is set: start the workers with srun, or give TF_CONFIG")
    return found

