"""The device process as a Ray actor (`--distributed-executor-backend ray`).

The actor runs the same `DeviceLoop` as the spawned device process; only the transport differs: the
actor connects back to the host over TCP (multiprocessing's authenticated `Connection`), since a Ray
actor may live on another node. `HostRuntime` drives it through `RayChannel` exactly as it drives a
pipe. Ray is an optional extra (`pip install -e '.[ray]'`), imported only here.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

import ray
import torch

from .api import ProgramFactory
from .device_loop import DeviceLoop
from .errors import DeviceStartupError
from .messages import DeviceMessage, HostMessage
from .transport import HostChannel, _PipeDeviceEnd

CONNECT_TIMEOUT_S = 120.0
"""How long the host waits for a started actor to connect back (it imports torch first)."""


class DeviceActor:
    """One rank's device, as a Ray actor class (wrapped by `ray.remote` at placement)."""

    def describe(self) -> tuple[str, int]:
        """(node IP, process id) of this actor."""
        return ray.util.get_node_ip_address(), os.getpid()

    def free_port(self) -> int:
        """A port free on this actor's node (rank 0 hosts the group's rendezvous there)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            return probe.getsockname()[1]

    def serve(
        self,
        address: tuple[str, int],
        authkey: bytes,
        factory: ProgramFactory,
        device_time_ms: float,
        device_threads: int,
    ) -> None:
        """Connect to the host and serve its messages until Shutdown or EOF (blocks the actor)."""
        torch.set_num_threads(device_threads)
        sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
        sock.settimeout(None)
        conn = Connection(sock.detach())
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
        try:
            DeviceLoop(device_time_ms).serve(_PipeDeviceEnd(conn), factory)
        finally:
            conn.close()


class RayGang:
    """The ranks' placement group: one bundle per rank, removed when the last rank's channel stops."""

    def __init__(self, size: int, ready_timeout_s: float) -> None:
        from ray.util.placement_group import placement_group

        self.size = size
        self.group = placement_group([{"CPU": 1}] * size, strategy="PACK")
        try:
            ray.get(self.group.ready(), timeout=ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._remove()
            raise DeviceStartupError(
                f"Ray placement group of {size} ranks (1 CPU each) not ready after {ready_timeout_s:g} s: "
                f"the cluster has {ray.cluster_resources().get('CPU', 0):g} CPUs"
            ) from None
        self._lock = threading.Lock()
        self._open = size

    def actor(self, rank: int) -> ray.actor.ActorHandle:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)
        remote = ray.remote(num_cpus=1, max_restarts=0)(DeviceActor)
        return remote.options(name=None, scheduling_strategy=strategy).remote()

    def release(self) -> None:
        with self._lock:
            self._open -= 1
            last = self._open == 0
        if last:
            self._remove()

    def _remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


class RayChannel(HostChannel):
    """Host end of the connection to a `DeviceActor` (its `serve` call blocks the actor)."""

    def __init__(
        self,
        gang: RayGang,
        actor: ray.actor.ActorHandle,
        factory: ProgramFactory,
        device_time_ms: float,
        device_threads: int,
    ) -> None:
        self._gang = gang
        self._actor = actor
        self._node, self._pid = ray.get(actor.describe.remote(), timeout=CONNECT_TIMEOUT_S)
        self._released = False
        authkey = secrets.token_bytes(32)
        server = socket.create_server(("", 0))
        server.settimeout(CONNECT_TIMEOUT_S)
        host = ray.util.get_node_ip_address()
        self._done = actor.serve.remote(
            (host, server.getsockname()[1]), authkey, factory, device_time_ms, device_threads
        )
        try:
            sock, _ = server.accept()
        except OSError as exc:
            self.kill()
            raise DeviceStartupError(f"device actor (process {self._pid}) did not connect back: {exc}") from exc
        finally:
            server.close()
        sock.settimeout(None)
        self._conn = Connection(sock.detach())
        deliver_challenge(self._conn, authkey)
        answer_challenge(self._conn, authkey)

    @property
    def pid(self) -> int | None:
        return self._pid  # on another node this pid is that node's

    def send(self, message: HostMessage) -> None:
        _PipeDeviceEnd(self._conn).send(message)  # type: ignore[arg-type]

    def recv(self) -> DeviceMessage:
        return _PipeDeviceEnd(self._conn).recv(block=True)  # type: ignore[return-value]

    def stop(self, grace_s: float) -> bool:
        ray.wait([self._done], timeout=grace_s)
        self.kill()
        self._conn.close()
        return True

    def kill(self) -> None:
        ray.kill(self._actor, no_restart=True)
        if not self._released:
            self._released = True
            self._gang.release()

    def describe_exit(self) -> str:
        try:
            ray.get(self._done, timeout=2.0)
        except ray.exceptions.GetTimeoutError:
            return f"lost the connection to device actor (process {self._pid} on {self._node})"
        except ray.exceptions.RayError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"device actor (process {self._pid} on {self._node}) died: {first}"
        return f"device actor (process {self._pid} on {self._node}) exited"
