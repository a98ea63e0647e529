"""Run on a host of the test bed (tfscale.launch.netbed): what that host sees of the network.

    netbed_probe.py recv ADDRESS PORT            accepts one connection, prints the Mbit/s it received
    netbed_probe.py send ADDRESS PORT BYTES      connects and sends BYTES
    netbed_probe.py connect ADDRESS:PORT ...     prints {"ADDRESS:PORT": "open" | "refused" | "timeout" | error}
    netbed_probe.py whoami                       prints {"hostname", "resolves": {name: address}, "routes"}
    netbed_probe.py spin SECONDS                 a busy loop; prints the CPU seconds it got per wall second

Standard library only: it starts in a few hundredths of a second.
"""

import json
import socket
import subprocess
import sys
import time

CONNECT_TIMEOUT_S = 2.0


def receive(address: str, port: int) -> None:
    with socket.create_server((address, port)) as server:
        print("listening", flush=True)
        connection, _ = server.accept()
        received, started = 0, None
        while chunk := connection.recv(1 << 16):
            started = started or time.perf_counter()
            received += len(chunk)
    print(f"{received * 8 / (time.perf_counter() - started) / 1e6:.2f}")


def send(address: str, port: int, num_bytes: int) -> None:
    with socket.create_connection((address, port), timeout=10) as connection:
        connection.sendall(b"\0" * num_bytes)


def try_connect(target: str) -> str:
    address, _, port = target.rpartition(":")
    try:
        socket.create_connection((address, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        return "open"
    except ConnectionRefusedError:
        return "refused"
    except socket.timeout:
        return "timeout"
    except OSError as err:
        return f"error {err.errno}"


def whoami(names: list[str]) -> dict:
    routes = subprocess.run(["ip", "-4", "-j", "route"], capture_output=True, text=True, check=True).stdout
    return {"hostname": socket.gethostname(), "resolves": {name: socket.gethostbyname(name) for name in names},
            "routes": [route["dst"] for route in json.loads(routes)]}


def spin(seconds: float) -> float:
    start_s, start_cpu_s = time.monotonic(), time.process_time()
    while time.monotonic() - start_s < seconds:
        pass
    return (time.process_time() - start_cpu_s) / (time.monotonic() - start_s)


if __name__ == "__main__":
    action, args = sys.argv[1], sys.argv[2:]
    if action == "recv":
        receive(args[0], int(args[1]))
    elif action == "send":
        send(args[0], int(args[1]), int(args[2]))
    elif action == "spin":
        print(f"{spin(float(args[0])):.3f}")
    elif action == "connect":
        print(json.dumps({target: try_connect(target) for target in args}))
    else:
        print(json.dumps(whoami(args)))
