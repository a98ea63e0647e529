"""horovodrun's rendezvous HTTP server (gloo_run.launch_gloo), run inside `tfscale.launch` at an address it chooses."""

from __future__ import annotations

import threading

from tfscale.config import HOROVOD_INSTALL_HINT
from tfscale.errors import LaunchError

HOROVOD_MISSING = f"backend horovod needs Horovod: {HOROVOD_INSTALL_HINT}"


class HorovodRendezvous:
    """`hvd.init()` in each worker fetches its peers from this key-value server; the plan tells the server
    how many workers join each scope (global, local_<host>, cross_<local rank>).

    Horovod's own `RendezvousServer.start` binds every interface (horovod/runner/util/network.py `find_port`:
    address ''); this one binds `address`: 127.0.0.1 when the workers are all on this host, so nobody else can
    reach it; a test bed's bridge address when they run on the bed's hosts. `slots`: horovodrun's -H list
    ("host:workers" each), every worker on this host by default.
    """

    def __init__(self, num_workers: int, address: str = "127.0.0.1", slots: list[str] | None = None):
        try:
            from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
            from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer
        except ImportError as err:
            raise LaunchError(f"{HOROVOD_MISSING} ({err})") from err
        # Port 0: the kernel picks a free port and the server keeps it bound: no window for another process.
        self._httpd = RendezvousHTTPServer((address, 0), RendezvousHandler, 0)
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="horovod-rendezvous", daemon=True)
        self._thread.start()
        hosts = parse_hosts(",".join(slots or [f"{address}:{num_workers}"]))
        self._httpd.init(get_host_assignments(hosts, num_workers))  # positional: names vary by version

    def stop(self) -> None:
        self._httpd.shutdown()
        self._thread.join()
