"""Weight transfer over a process group: trainer rank 0 broadcasts, every server receives.

Handshake (SGLang's protocol, see DESIGN.md): rank 0 hosts a TCP store, posts
``/init_weights_update_group`` to every server (the call blocks until the
rendezvous, so it runs in the background) and joins the group itself as rank 0.

Per update (``transfer``, the servers paused by the publisher), on rank 0:

    rebuild the group if its members are not the servers in rotation
    begin_weight_update                      (SGLang >= 0.5.21; skipped on older servers)
    for each bucket of ``weight_sync.bucket_size_mb``:
        post /update_weights_from_distributed {names, dtypes, shapes[, weight_version: last bucket only]}
        broadcast the bucket's tensors in ``names`` order  (concurrently with the HTTP call)
        await the HTTP answer
    end_weight_update

A bucket whose tensors share one dtype is sent as a single flattened broadcast
(``load_format: flattened_bucket``); bytes on the wire are the same as SGLang's
uint8-flattened bucket. ``stage`` does nothing: a broadcast needs the servers paused.
It is used on trainer rank 0; the publisher keeps the other ranks reading the source
(unsharding is a collective) in step, again each time the transfer starts over.

Server faults: a server that fails an admin call and then its health probe is dropped
from rotation and weight updates, and the call is repeated on the others. Before
each update the group is compared with the servers in rotation and rebuilt (new
group name and port) when they differ. A member dying during the transfer fails
the broadcast; rank 0 then finishes reading, rebuilds the group over the
survivors and reads the buckets again (and so does every rank). With no server left the
transfer raises `WeightSyncError`.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import uuid
from collections.abc import Callable, Coroutine
from typing import Literal, TypeVar

import torch

from arealite.api.contracts import DistributedUpdateAdmin, Runner, WeightSource, require
from arealite.utils.net import free_port, host_ip, split_addr
from arealite.weight_sync.base import (
    Timer,
    cast_for_servers,
    WeightSyncError,
    admin_error,
    bucket_bytes_of,
    call_dropping_dead,
    end_session,
    logger,
    no_server_left,
    with_last,
)
from arealite.weight_sync.group import Layout, UpdateGroup

_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}

T = TypeVar("T")


def in_thread(fn: Callable[[], T], name: str) -> cf.Future[T]:
    """Run `fn` in a daemon thread; a collective stuck on a dead peer must not block exit."""
    fut: cf.Future[T] = cf.Future()

    def body():
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # handed to the waiting thread, which raises it
            fut.set_exception(e)

    threading.Thread(target=body, name=name, daemon=True).start()
    return fut


def resolve_backend(backend: str) -> str:
    """`weight_sync.backend`: `auto` is nccl on CUDA, else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


class DistributedTransfer:
    """Moves weights from trainer rank 0 to every server over a gloo/NCCL group.

    `admin` is the servers' administration (of an initialized client); `run(coro)` runs
    one of its coroutines on the client's event loop and returns the result
    (``RolloutController.run``). `wire_dtype` casts the weights before sending (the
    servers' dtype, e.g. bfloat16 on GPUs; None keeps the trainer's). `layout` picks the
    store key layout (``auto`` asks the servers which engine they run).
    """

    def __init__(self, config, admin: DistributedUpdateAdmin, run: Runner, *,
                 wire_dtype: torch.dtype | None = None, layout: Literal["auto"] | Layout = "auto",
                 flattened: bool = False):
        require(admin, DistributedUpdateAdmin, "the servers' admin of weight_sync.method=distributed")
        self.config = config
        self.admin = admin
        self.run = run
        self.wire_dtype = wire_dtype
        self.layout = layout
        self.flattened = flattened
        self.backend = resolve_backend(config.backend)
        self.group_name = f"arealite_weights_{uuid.uuid4().hex[:8]}"
        self.group: UpdateGroup | None = None
        self._layout: Layout = "sglang"
        self._master = "127.0.0.1"
        self._broken: str | None = None
        self._initialized = False

    @property
    def server_dtype(self) -> torch.dtype | None:
        """The dtype the servers receive (None: the trainer's)."""
        return self.wire_dtype

    @property
    def bucket_bytes(self) -> int:
        return bucket_bytes_of(self.config)

    # -- set-up --------------------------------------------------------------------------

    def _detect_layout(self) -> Layout:
        if self.layout != "auto":
            return self.layout
        kinds = set()
        for addr in self.admin.servers:
            info = self.admin.server_info(addr)
            kinds.add("embedded" if info.get("engine") == "arealite-embedded" else "sglang")
        if len(kinds) > 1:
            raise WeightSyncError("the servers mix arealite-embedded and SGLang engines; one "
                                  "weight-update group cannot serve both (use weight_sync.method=disk)")
        return kinds.pop() if kinds else "sglang"

    def _master_addr(self) -> str:
        hosts = {split_addr(a)[0] for a in self.admin.servers}
        return "127.0.0.1" if hosts <= _LOCAL_HOSTS else host_ip()

    def init(self, master_addr: str | None = None) -> None:
        """Build the weight-update group (this trainer rank and every server)."""
        if self._initialized:
            return
        self._initialized = True
        self._layout = self._detect_layout()
        self._master = master_addr or self._master_addr()
        self._build_group(version=None)

    def _build_group(self, version: int | None) -> None:
        """Rendezvous rank 0 with every server in rotation under `self.group_name`."""
        timeout = self.config.timeout_s
        master_addr = self._master
        port = free_port(master_addr)  # the store listens on master_addr alone
        store = UpdateGroup.host_store(master_addr, port, timeout)
        world_size = self.admin.weights_update_world_size()
        if world_size < 2:
            raise no_server_left(self.admin, version)
        name = self.group_name
        http = in_thread(lambda: self.run(self.admin.init_weights_update_group(
            master_addr, port, world_size, name, self.backend, timeout=timeout)),
            "weight-sync-init-http")
        join = in_thread(lambda: UpdateGroup.join(
            store, group_name=name, world_size=world_size, backend=self.backend,
            layout=self._layout, timeout_s=timeout), "weight-sync-init-join")
        self._wait_both(http, join, timeout, version=version, what="init_weights_update_group",
                        names=[])
        self.group = join.result()
        self._broken = None
        logger.info("weight-update group %s: %d server rank(s) joined over %s (%s:%d)",
                    name, world_size - 1, self.backend, master_addr, port)

    def _regroup(self, version: int) -> None:
        """Replace the group by one over the servers in rotation now (a member died or joined).

        Closing our end first also ends any receive a survivor is still blocked in.
        """
        old_members = self.admin.group_members(self.group_name)
        # The survivors drop their end in the background: one may still be blocked in a
        # receive of the old group until it sees our end close (or its own timeout), and
        # that must not hold up the new group, which it joins in another thread.
        self._tear_down(version)
        # Make sure that nobody who is gone is asked to join (the rendezvous would time out).
        self.run(self.admin.drop_unreachable(why="a weight-update group change"))
        self.group_name = f"arealite_weights_{uuid.uuid4().hex[:8]}"
        left = sorted(set(old_members) - set(self.admin.healthy_servers))
        joined = sorted(set(self.admin.healthy_servers) - set(old_members))
        logger.warning("weight-update group rebuilt as %s for version %d over %d server(s) (%s)%s%s",
                       self.group_name, version, len(self.admin.healthy_servers),
                       ", ".join(self.admin.healthy_servers),
                       f"; dropped: {', '.join(left)}" if left else "",
                       f"; joined: {', '.join(joined)}" if joined else "")
        self._build_group(version)

    # -- one update ----------------------------------------------------------------------

    def _admin(self, make_coro: Callable[[], Coroutine[object, object, T]], version: int, what: str) -> T:
        return call_dropping_dead(self.run, self.admin, make_coro, version, what)

    def _wait_both(self, http: cf.Future, bcast: cf.Future, timeout: float, version: int | None,
                   what: str, names: list[str]) -> None:
        """Wait for an HTTP call and its collective; fail fast if either fails."""
        done, _ = cf.wait([http, bcast], timeout=timeout, return_when=cf.FIRST_EXCEPTION)
        for fut, kind in ((http, "http"), (bcast, "collective")):
            if fut in done and fut.exception() is not None:
                e = fut.exception()
                self._broken = f"{what} failed: {e}"
                tensor = next((n for n in names if repr(n) in str(e) or n in str(e)), None)
                if kind == "http":
                    if isinstance(e, WeightSyncError):
                        raise e
                    raise admin_error(e, version, tensor) from e
                raise WeightSyncError(f"{what}: the broadcast failed: {e}", tensor=tensor,
                                      version=version) from e
        if len(done) < 2:
            self._broken = f"{what} timed out"
            raise WeightSyncError(
                f"{what}: no answer within weight_sync.timeout_s={timeout:g}s "
                f"({'HTTP call' if http not in done else 'broadcast'} still pending)",
                version=version)

    def _prepare(self, name: str, t: torch.Tensor) -> torch.Tensor:
        t = cast_for_servers(name, t.detach(), self.wire_dtype)
        device = self.group.device if self.group is not None else t.device
        return t.to(device).contiguous()

    def stage(self, source: WeightSource, version: int) -> dict[str, float]:
        """Nothing to stage: the weights go out in `transfer`, with the servers paused."""
        return {}

    def transfer(self, source: WeightSource, version: int) -> dict[str, float]:
        """Send `source`'s weights as `version` to every server; returns timings (rank 0).

        Each attempt opens one weight-update session on the servers and always closes it
        (SGLang refuses a second begin while one is open). A server that is gone (before or
        during the transfer) is dropped, the group is rebuilt over the others and the
        transfer repeated (reading `source` anew); any other failure, or no server left,
        tears the group down and raises `WeightSyncError` naming the server.
        """
        if self._broken:
            raise WeightSyncError(f"the weight-update group is broken ({self._broken}); "
                                  "restart the run", version=version)
        timer = Timer()
        attempts = 0
        while True:
            attempts += 1
            if self.group is None or (set(self.admin.group_members(self.group_name))
                                      != set(self.admin.healthy_servers)):
                self._regroup(version)
            self._admin(self.admin.begin_weight_update, version, "begin_weight_update")
            timer.lap("group_s")
            try:
                counts = self._attempt(source, version)
            except BaseException:
                self._tear_down(version)
                raise
            finally:
                end_session(self.run, self.admin, version)
            if counts is not None:
                break
        timer.lap("transfer_s")
        n_buckets, n_tensors, n_bytes = counts
        out = dict(timer.timings, bytes=float(n_bytes), n_buckets=float(n_buckets),
                   n_tensors=float(n_tensors), attempts=float(attempts),
                   n_servers=float(len(self.admin.healthy_servers)))
        logger.info("version %d broadcast: %d tensors, %.1f MB in %d bucket(s), %d attempt(s)",
                    version, n_tensors, n_bytes / 2**20, n_buckets, attempts)
        return out

    def _tear_down(self, version: int) -> None:
        """After a failed transfer: drop our end of the group (a server still blocked in a
        receive sees its peer go) and ask the servers to leave it, in the background."""
        if self.group is None:
            return
        name = self.group_name
        self.group.close()
        self.group = None
        fut = in_thread(lambda: self.run(self.admin.destroy_weights_update_group(name)), "weight-sync-destroy")
        fut.add_done_callback(lambda f: f.exception() and logger.warning(
            "version %d: destroy_weights_update_group %s failed (ignored): %s", version, name, f.exception()))

    def _attempt(self, source: WeightSource, version: int) -> tuple[int, int, int] | None:
        """Broadcast every bucket once; None when a member died and the transfer goes again."""
        buckets = iter(source.named_weight_buckets(self.bucket_bytes))
        try:
            return self._broadcast_all(buckets, version)
        except (WeightSyncError, RuntimeError) as e:
            lost = self._lost_members(version)
            if not lost:
                raise
            for _ in buckets:  # the other ranks unshard every bucket: keep in step
                pass
            logger.warning("version %d: inference server(s) %s died during the weight transfer "
                           "(%s); dropped from rotation and weight updates, sending again "
                           "to the %d left", version, ", ".join(lost), e,
                           len(self.admin.healthy_servers))
            # Survivors may be blocked in a receive of this group: closing our end frees them
            # (before their sessions are closed and they join the next group).
            self._tear_down(version)
            self._broken = None
            return None

    def _broadcast_all(self, buckets, version: int) -> tuple[int, int, int]:
        """Broadcast every bucket to the group; returns (buckets, tensors, bytes).

        Only the last bucket carries ``weight_version``: SGLang relabels a server after every
        update call that carries one, so a push failing halfway would otherwise leave servers
        reporting the new version over a mix of old and new weights. Knowing which bucket is
        the last costs reading one bucket ahead (one more bucket held in memory).
        """
        timeout = self.config.timeout_s
        n_bytes = n_tensors = n_buckets = 0
        for bucket, last in with_last(buckets):
            names = [n for n, _ in bucket]
            tensors = [self._prepare(name, t) for name, t in bucket]
            flat = self.flattened and len(tensors) > 1 and len({t.dtype for t in tensors}) == 1
            coro = self.admin.update_weights_from_distributed(
                names, [t.dtype for t in tensors], [list(t.shape) for t in tensors],
                self.group_name, version if last else None, flattened_bucket=flat, timeout=timeout)
            http = in_thread(lambda c=coro: self.run(c), "weight-sync-http")
            send = [torch.cat([t.reshape(-1) for t in tensors])] if flat else tensors
            # Issuing the collective runs in the thread too: NCCL's first collective on a group
            # blocks in the call until every rank joins, and a server that refused its HTTP
            # call never will; the HTTP failure (or the timeout) must be able to end the wait.
            bcast = in_thread(lambda g=self.group, x=send: [w.wait() for w in g.broadcast(x)],
                              "weight-sync-broadcast")
            self._wait_both(http, bcast, timeout, version, "update_weights_from_distributed", names)
            n_buckets += 1
            n_tensors += len(tensors)
            n_bytes += sum(t.numel() * t.element_size() for t in tensors)
        return n_buckets, n_tensors, n_bytes

    def _lost_members(self, version: int) -> list[str]:
        """Group members that are gone (dead, or out of rotation) after a failed transfer."""
        members = self.admin.group_members(self.group_name)
        self.run(self.admin.drop_unreachable(members, why=f"a failed transfer of version {version}"))
        healthy = set(self.admin.healthy_servers)
        lost = [a for a in members if a not in healthy]
        if lost and not healthy:
            raise no_server_left(self.admin, version)
        return lost

    def close(self) -> None:
        """Tear the group down on the servers and here (rank 0); safe to call twice."""
        if self.group is None:
            return
        if not self._broken:
            try:
                self.run(self.admin.destroy_weights_update_group(self.group_name))
            except Exception as e:  # closing must not mask the error that led here
                logger.warning("destroy_weights_update_group failed: %s", e)
        self.group.close()
        self.group = None
