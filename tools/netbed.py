#!/usr/bin/env python3
"""Bring up, list and take down a test bed of hosts on this machine (network namespaces, shaped links).

    sudo python tools/netbed.py up --hosts=3 [--rate_mbit=100] [--prefix=tfsnb] [--subnet=10.213.X.0/24]
    sudo python tools/netbed.py status [--prefix=tfsnb]
    sudo python tools/netbed.py exec --host=1 -- python -c 'import socket; print(socket.gethostname())'
    sudo python tools/netbed.py cpu --host=1 --cpu_fraction=0.7   # host 1 a straggler: 70 % of one core
    sudo python tools/netbed.py down [--prefix=tfsnb]

`python -m tfscale.launch --netbed=PREFIX ...` then starts worker i on host i. What the bed is and how it
is taken down: tfscale/launch/netbed.py.
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from tfscale.launch import netbed  # noqa: E402

_PREFIX = flags.DEFINE_string("prefix", netbed.DEFAULT_PREFIX, "Starts every name the bed makes.")
_HOSTS = flags.DEFINE_integer("hosts", 2, "up: how many hosts.")
_SUBNET = flags.DEFINE_string("subnet", None, "up: the bed's private IPv4 subnet (default: the first free "
                              f"{netbed.SUBNETS[0]} ... {netbed.SUBNETS[-1]}).")
_RATE = flags.DEFINE_float("rate_mbit", None, "up: each host's link rate in both directions (default: unshaped).")
_HOST = flags.DEFINE_integer("host", 0, "exec, cpu: the host to run the command on, or to limit.")
_CPU = flags.DEFINE_float("cpu_fraction", None, "cpu: the host's share of the machine, in cores, for every process "
                          "started on it from now on (default: no limit).")
ACTIONS = ("up", "status", "exec", "cpu", "down")


def main(argv):
    if len(argv) < 2 or argv[1] not in ACTIONS:
        raise app.UsageError(f"give one of: {', '.join(ACTIONS)}")
    action, command = argv[1], argv[2:]
    try:
        if action == "up":
            bed = netbed.up(_PREFIX.value, _HOSTS.value, _SUBNET.value, _RATE.value)
            print(json.dumps(bed.to_json(), indent=1))
        elif action == "status":
            bed = netbed.load(_PREFIX.value)
            print(json.dumps({**bed.to_json(), "qdiscs": netbed.qdiscs(bed)}, indent=1))
        elif action == "exec":
            if not command:
                raise app.UsageError("exec: give the command after --")
            bed = netbed.load(_PREFIX.value)
            argv = bed.host_command(_HOST.value, command)
            os.execvp(argv[0], argv)
        elif action == "cpu":
            bed = netbed.set_cpu(netbed.load(_PREFIX.value), _HOST.value, _CPU.value)
            print(json.dumps(bed.to_json()["hosts"][_HOST.value], indent=1))
        else:
            for line in netbed.down(_PREFIX.value):
                print(f"removed {line}")
    except (netbed.NetbedError, ValueError) as err:
        sys.exit(f"netbed: {err}")


if __name__ == "__main__":
    app.run(main)
