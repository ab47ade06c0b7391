"""Pieces shared by the weight publisher and the transfers: errors, ranks, the read-back check.

A weight update moves the trainer's weights to every inference server. Whatever
the transfer, the same rules hold (`publisher.WeightPublisher` enforces them):

- only trainer rank 0 talks to the servers; every rank still iterates
  ``engine.named_weight_buckets`` (unsharding is a collective) and then learns from
  rank 0 how the update ended (`agree`);
- every update carries its ``weight_version``, and the servers take it on only with the
  update's last call (a transfer in several calls labels its last one alone: a server
  relabelled by a push that then failed would report the new version over mixed weights);
- afterwards the update is verified (by default a sample of tensors is read back
  with ``get_weights_by_name`` and compared with the trainer's copy); any failure
  raises ``WeightSyncError`` and the servers are left paused, so that none of them
  keeps serving old weights as if nothing had happened.
"""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

from arealite.api.contracts import Runner, WeightSource, WeightUpdateAdmin
from arealite.quant.fp8 import FP8_DTYPE, SCALE_SUFFIX
from arealite.utils.buckets import buckets_of  # noqa: F401  (re-exported)
from arealite.utils.json_types import JsonObject, JsonValue

logger = logging.getLogger("arealite.weight_sync")

#: Rows read back per sampled tensor (``truncate_size``; the first values of a 1-D one). The
#: sample of tensors changes every version; a few rows of each say whether the bytes arrived,
#: at a cost that stays small next to the push (100 rows of a 2-D weight were most of it).
VERIFY_TRUNCATE = 4

T = TypeVar("T")


class AdminCall(Protocol):
    """Runs one admin call, surviving dead servers: ``call(make_coro, what)`` (see
    `call_dropping_dead`); returns the call's answer."""

    def __call__(self, make_coro: Callable[[], Coroutine[object, object, T]], what: str) -> T: ...


class WeightSyncError(RuntimeError):
    """A weight update failed; the run must stop (servers are left paused).

    ``server``, ``tensor`` and ``cause`` say where and why (either of the first two may
    be None when it does not apply).
    """

    def __init__(self, cause: str, *, server: str | None = None, tensor: str | None = None,
                 version: int | None = None):
        self.server, self.tensor, self.cause, self.version = server, tensor, cause, version
        where = []
        if version is not None:
            where.append(f"version {version}")
        if server is not None:
            where.append(f"server {server}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        prefix = f"weight sync ({', '.join(where)})" if where else "weight sync"
        super().__init__(
            f"{prefix} failed: {cause}. The servers stay paused so that none serves stale "
            "weights; stop the run and check the server logs.")


class StateDictSource:
    """A `WeightSource` over a plain (unsharded) model or state dict, in HF names.

    Tied weights (tensors sharing storage) are given once, under their first
    name, as in an HF safetensors file. Used by tests, benchmarks and single-process
    scripts that train without FSDP.
    """

    def __init__(self, model_or_state: torch.nn.Module | dict[str, torch.Tensor]):
        if isinstance(model_or_state, torch.nn.Module):
            state = model_or_state.state_dict()
        else:
            state = dict(model_or_state)
        seen: set[int] = set()
        self.tensors: list[tuple[str, torch.Tensor]] = []
        for name, t in state.items():
            key = t.untyped_storage().data_ptr() if t.numel() else id(t)
            if key in seen:
                continue
            seen.add(key)
            self.tensors.append((name, t.detach()))

    def named_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of at most `bucket_bytes` (a larger tensor is a bucket of its own)."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0 (weight_sync.bucket_size_mb)")
        yield from buckets_of(self.tensors, bucket_bytes)


def bucket_bytes_of(config) -> int:
    """`weight_sync.bucket_size_mb` in bytes."""
    return max(1, int(config.bucket_size_mb * (1 << 20)))


def cast_for_servers(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` in the servers' weight `dtype` (None: as it is). An FP8 weight and its float32
    ``weight_scale_inv`` (`fp8_push.Fp8Source`) go as they are: the servers hold them so."""
    if dtype is None or t.dtype == dtype or t.dtype == FP8_DTYPE or name.endswith(SCALE_SUFFIX):
        return t
    return t.to(dtype)


def trainer_rank() -> tuple[int, int]:
    """(rank, world size) of this trainer process in the default group ((0, 1) without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


#: `agree` statuses: done / rank 0 lost a server and every rank iterates again / rank 0 failed.
DONE, RETRY, FAILED = 0, 1, 2
#: Rank 0 read the source in full: every rank runs the publisher's ``after_read``, then learns the end.
READ = 3


def agree(status: int | None = None) -> int:
    """Every trainer rank learns rank 0's `status` (a collective; returns it as is alone).

    Replaces a plain barrier at the end of a step, so that after a server dies
    mid-transfer all ranks iterate the (collective) weight buckets once more together,
    and so that a failure on rank 0 stops every rank with an error rather than a hang.
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return DONE if status is None else status
    box = [status]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def rank0_failed(version: int | None) -> WeightSyncError:
    """What ranks other than 0 raise when rank 0 reports `FAILED`."""
    return WeightSyncError("trainer rank 0 failed (its log has the cause)", version=version)


def call_dropping_dead(run: Runner, admin: WeightUpdateAdmin,
                       make_coro: Callable[[], Coroutine[object, object, T]], version: int, what: str) -> T:
    """Run the admin call ``make_coro()`` on the servers in rotation, surviving dead ones.

    When it fails, the failing servers are probed: those that are gone leave the
    rotation (logged) and the call is repeated on the rest. A failure from a live
    server (a refused update) raises `WeightSyncError`, as does running out of servers.
    """
    while True:
        try:
            return run(make_coro())
        except WeightSyncError:
            raise
        except Exception as e:  # ServerAdminError / NoHealthyServerError from the client
            failures = getattr(e, "failures", None)
            suspects = list(failures) if isinstance(failures, dict) and failures else None
            dropped = run(admin.drop_unreachable(suspects, why=f"{what} failed"))
            if not admin.healthy_servers:
                raise no_server_left(admin, version) from e
            # A failing server that the generation path took out meanwhile is gone too.
            healthy = set(admin.healthy_servers)
            dropped = sorted(set(dropped) | {a for a in suspects or () if a not in healthy})
            if not dropped:
                raise admin_error(e, version) from e
            logger.warning("inference server(s) %s did not answer %s and are gone: dropped from "
                           "rotation and weight updates; %d server(s) left: %s", ", ".join(dropped),
                           what, len(admin.healthy_servers), ", ".join(admin.healthy_servers))


def end_session(run: Runner, admin: WeightUpdateAdmin, version: int) -> None:
    """Close the servers' weight-update session (``end_weight_update``) after a push; when
    the push itself is failing, a failure here is logged, not raised over the push's own."""
    try:
        call_dropping_dead(run, admin, admin.end_weight_update, version, "end_weight_update")
    except WeightSyncError as e:
        if sys.exc_info()[0] is None:
            raise
        logger.warning("version %d: closing the weight-update session failed too: %s", version, e)


def with_last(items: Iterator[T]) -> Iterator[tuple[T, bool]]:
    """``(item, is_last)`` for each item, reading one item ahead."""
    it = iter(items)
    try:
        current = next(it)
    except StopIteration:
        return
    for following in it:
        yield current, False
        current = following
    yield current, True


def no_server_left(admin: WeightUpdateAdmin, version: int | None) -> WeightSyncError:
    """The error when every inference server is gone."""
    detail = "; ".join(f"{a}: {why}" for a, why in admin.out_of_rotation().items())
    return WeightSyncError(f"no inference server is left to update (all of them died or left "
                           f"the rotation: {detail})", version=version)


def drain(source: WeightSource, bucket_bytes: int) -> None:
    """Iterate every bucket without using it: what ranks other than 0 do (it is collective)."""
    for _ in source.named_weight_buckets(bucket_bytes):
        pass


class ReadbackSample:
    """Reservoir sample of `k` tensors seen during an update, kept for the read-back check.

    The sample is drawn anew each version (seeded by it), so successive updates
    check different tensors. What is kept is what `get_weights_by_name`
    returns: the first `VERIFY_TRUNCATE` rows (SGLang and the embedded server),
    compared flattened as ``t[:VERIFY_TRUNCATE].flatten()``.
    """

    def __init__(self, k: int, version: int):
        self.k = k
        self._rng = random.Random(version)
        self._seen = 0
        self.expected: dict[str, torch.Tensor] = {}

    def offer(self, name: str, t: torch.Tensor) -> None:
        if self.k <= 0:
            return
        self._seen += 1
        if len(self.expected) < self.k:
            self.expected[name] = _head(t)
            return
        j = self._rng.randrange(self._seen)
        if j < self.k:
            victim = list(self.expected)[j]
            del self.expected[victim]
            self.expected[name] = _head(t)


def _head(t: torch.Tensor) -> torch.Tensor:
    head = t[:VERIFY_TRUNCATE] if t.dim() > 0 else t.reshape(1)
    return head.detach().reshape(-1).to(device="cpu", dtype=torch.float32).clone()


def _flatten_values(values: JsonValue) -> list[float]:
    out: list[float] = []
    stack = [values]
    # Iterative flatten: a nested list of any depth (SGLang returns rows of a 2-D weight).
    while stack:
        v = stack.pop()
        if isinstance(v, (list, tuple)):
            stack.extend(reversed(v))
        else:
            out.append(float(v))
    return out


def tolerance_for(dtype: torch.dtype | None) -> tuple[float, float]:
    """(rtol, atol) of the read-back comparison for the servers' weight dtype."""
    if dtype in (torch.bfloat16, torch.float16):
        return 1e-2, 1e-3
    return 1e-5, 1e-6


def compare_readback(expected: dict[str, torch.Tensor], answers: dict[str, JsonObject],
                     version: int, dtype: torch.dtype | None = None) -> None:
    """Check `get_weights_by_name` answers (`{tensor: {server: values}}`) against `expected`.

    Raises `WeightSyncError` naming the first server and tensor that disagree.
    """
    rtol, atol = tolerance_for(dtype)
    for name, want in expected.items():
        per_server = answers.get(name)
        if not per_server:
            raise WeightSyncError("no server answered get_weights_by_name", tensor=name,
                                  version=version)
        for server, values in per_server.items():
            if isinstance(values, dict):  # tolerate {"values": [...]}-style answers
                values = values.get("values", values.get("weights"))
            try:
                got = torch.tensor(_flatten_values(values), dtype=torch.float32)
            except (TypeError, ValueError):
                raise WeightSyncError(f"get_weights_by_name returned {str(values)[:80]!r}, "
                                      "not a list of numbers", server=server, tensor=name,
                                      version=version) from None
            n = got.numel()
            if n == 0 or n > want.numel():
                raise WeightSyncError(
                    f"get_weights_by_name returned {n} values where 1..{want.numel()} were "
                    "expected (the tensor's shape differs from the trainer's)",
                    server=server, tensor=name, version=version)
            ref = want[:n]
            if not torch.allclose(got, ref, rtol=rtol, atol=atol):
                diff = (got - ref).abs()
                i = int(diff.argmax())
                raise WeightSyncError(
                    f"read-back mismatch: server has {got[i].item():.6g} at flat index {i}, "
                    f"trainer has {ref[i].item():.6g} (max abs diff {diff.max().item():.3g})",
                    server=server, tensor=name, version=version)


def admin_error(e: Exception, version: int, tensor: str | None = None) -> WeightSyncError:
    """Turn a client admin failure (``ServerAdminError``) into a `WeightSyncError`."""
    failures = getattr(e, "failures", None)
    route = getattr(e, "route", "")
    if isinstance(failures, dict) and failures:
        server, cause = next(iter(failures.items()))
        more = f" (and {len(failures) - 1} other server(s))" if len(failures) > 1 else ""
        return WeightSyncError(f"{route}: {cause}{more}", server=server, tensor=tensor,
                               version=version)
    return WeightSyncError(f"{type(e).__name__}: {e}", tensor=tensor, version=version)


def thread_cpu_clock(thread_id: int | None = None) -> Callable[[], float]:
    """CPU seconds of one thread (this one when None; Linux clocks of other threads), as a clock."""
    if thread_id is None or thread_id == threading.get_ident():
        return time.thread_time
    clock = time.pthread_getcpuclockid(thread_id)
    return lambda: time.clock_gettime(clock)


class Timer:
    """Accumulates named phase durations for the timings an update returns, and with ``cpu``
    (a clock of CPU seconds) the CPU each phase cost: ``<phase>_client_cpu_s``."""

    def __init__(self, cpu: Callable[[], float] | None = None):
        self.t0 = time.perf_counter()
        self.timings: dict[str, float] = {}
        self._last = self.t0
        self.cpu = cpu
        self._cpu0 = self._cpu_last = cpu() if cpu is not None else 0.0

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = self.timings.get(name, 0.0) + now - self._last
        self._last = now
        if self.cpu is not None:
            c = self.cpu()
            key = name.removesuffix("_s") + "_client_cpu_s"
            self.timings[key] = self.timings.get(key, 0.0) + c - self._cpu_last
            self._cpu_last = c

    def total(self) -> dict[str, float]:
        self.timings["total_s"] = time.perf_counter() - self.t0
        if self.cpu is not None:
            self.timings["total_client_cpu_s"] = self.cpu() - self._cpu0
        return self.timings
