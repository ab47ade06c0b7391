"""SGLang's administration routes: what a weight update asks of the servers.

`SGLangAdmin` implements ``WeightUpdateAdmin`` (and its distributed and shared-memory
extensions, see `arealite.api.contracts`) over the `ServerPool` that the generation
client uses, so that both see the same rotation: a server that leaves it for one
leaves it for the other, and while ``pause_generation`` lasts the client holds its
requests. Every call goes to the servers in rotation concurrently and raises one
`ServerAdminError` naming every server that failed.

Only trainer rank 0 uses it, through the weight publisher (`arealite.weight_sync`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from arealite.inference_client.errors import ServerAdminError
from arealite.inference_client.server_pool import ServerPool, ServerPoolView, ServerState
from arealite.inference_client.sglang_wire import has_weight_update_brackets, parse_prompt_logprobs, prompt_score_body
from arealite.inference_client.server_ready import wait_until_warm
from arealite.config.weight_sync import PAUSE_MODES
from arealite.utils.json_types import JsonObject, JsonValue

if TYPE_CHECKING:
    import torch

__all__ = ["SGLangAdmin"]


def _dtype_names(dtypes: Sequence[torch.dtype | str]) -> list[str]:
    return [str(d).removeprefix("torch.") for d in dtypes]


def _shape_lists(shapes: Sequence[Sequence[int]]) -> list[list[int]]:
    return [[int(x) for x in shp] for shp in shapes]


class SGLangAdmin(ServerPoolView):
    """Pause/continue, cache, weight loading and the weight-update group on SGLang servers.

    It sets no version on anyone: the servers are tagged by the update itself, and the
    trainer's parties (client included) learn the version from the weight publisher once
    the update is verified.
    """

    def __init__(self, pool: ServerPool, pause_mode: str = "abort"):
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode {pause_mode!r}: expected one of {', '.join(PAUSE_MODES)} "
                             "(weight_sync.pause_mode)")
        self.pool = pool
        self.pause_mode = pause_mode
        """SGLang's pause mode for weight updates (`weight_sync.pause_mode`)."""
        self._groups: dict[str, list[str]] = {}  # weight-update group -> member servers
        self.lora_path: str | None = None  # the LoRA adapter the log-prob probe scores with (LoRA runs)

    # ------------------------------------------------------------ generation

    @property
    def flush_on_load(self) -> bool:
        """Whether a weight load asks the servers to flush their cache: not in ``in_place`` mode,
        where SGLang's flush fails while requests are frozen in the batch (and its scheduler's
        assertion after the load takes the server down); the old KV is kept, as the mode says."""
        return self.pause_mode != "in_place"

    async def pause_generation(self, mode: str | None = None) -> dict[str, JsonValue]:
        """Pause every server in ``mode`` (None: ``pause_mode``): with ``abort`` in-flight requests return with
        finish reason ``abort``; with ``retract`` and ``in_place`` they stay in the servers and
        finish after ``continue_generation`` (nothing comes back to resubmit).

        Until ``continue_generation``, resubmissions and new requests wait in
        the client (at most its ``max_pause_s``), not on the servers. A server is paused
        only once its start-up warm-up is over (`wait_until_warm`): SGLang kills itself
        when its warm-up request waits out a pause longer than its warm-up timeout.
        """
        if self.pool.running.is_set():  # not paused by us already
            await wait_until_warm(self.pool)
        self.pool.hold()
        return await self.pool.pausing(self.pool.call_all("/pause_generation", {"mode": mode or self.pause_mode}))

    async def continue_generation(self) -> dict[str, JsonValue]:
        """Resume generation on every server after ``pause_generation``; held requests go out."""
        try:
            return await self.pool.call_all("/continue_generation", {})
        finally:
            # Even after a failure: a server still paused holds its requests, as without the
            # client's pause, and the fault handling moves them.
            self.pool.release()

    async def flush_cache(self) -> dict[str, JsonValue]:
        """Drop every server's prefix (KV) cache."""
        return await self.pool.call_all("/flush_cache", {})

    # --------------------------------------------------------------- weights

    async def update_weights_from_disk(self, path: str, version: int, *,
                                       timeout: float | None = None) -> dict[str, JsonValue]:
        """Load an HF-format directory on every healthy server, tagged ``version``."""
        self.pool.exclude_unhealthy(f"the weight update to version {version}")
        return await self.pool.call_all(
            "/update_weights_from_disk", {"model_path": str(path), "weight_version": str(int(version)),
                                          "flush_cache": self.flush_on_load},
            timeout=timeout)

    async def load_lora_adapter(self, name: str, path: str, *, timeout: float | None = None) -> dict[str, JsonValue]:
        """Load the PEFT adapter directory ``path`` as ``name`` on every healthy server (SGLang's
        ``/load_lora_adapter``; the server needs ``--enable-lora``)."""
        self.pool.exclude_unhealthy(f"loading LoRA adapter {name}")
        return await self.pool.call_all("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
                                        timeout=timeout)

    async def unload_lora_adapter(self, name: str, *, timeout: float | None = None,
                                  missing_ok: bool = False) -> dict[str, JsonValue]:
        """Unload adapter ``name`` on every healthy server (``/unload_lora_adapter``). With
        ``missing_ok`` a server that does not hold it (SGLang: "LoRA with name X does not
        exist") is no failure; it answers ``None``."""
        route = "/unload_lora_adapter"
        self.pool.exclude_unhealthy(f"unloading LoRA adapter {name}")
        try:
            return await self.pool.call_all(route, {"lora_name": name}, timeout=timeout)
        except ServerAdminError as e:
            if not missing_ok:
                raise
            real = {a: why for a, why in e.failures.items() if not _adapter_missing(why)}
            if real:
                raise ServerAdminError(route, real, e.results) from None
            return {**e.results, **dict.fromkeys(e.failures)}

    async def update_weights_from_shm(self, path: str, names: Sequence[str], dtypes: Sequence[torch.dtype | str],
                                      shapes: Sequence[Sequence[int]], offsets: Sequence[int],
                                      version: int, *, timeout: float | None = None,
                                      alias: bool = False) -> dict[str, JsonValue]:
        """Load every weight from a shared-memory file on every healthy server, tagged ``version``.

        Tensor ``names[i]`` lies at byte ``offsets[i]`` of ``path`` with ``dtypes[i]``
        (torch dtypes or strings) and ``shapes[i]``. Embedded servers on this host only.
        ``alias``: the servers serve straight out of the file (no copy); the caller must not
        write it again until they have moved to another one.
        """
        route = "/update_weights_from_shm"
        if not len(names) == len(dtypes) == len(shapes) == len(offsets):
            raise ValueError(
                f"{route}: names ({len(names)}), dtypes ({len(dtypes)}), shapes ({len(shapes)}) "
                f"and offsets ({len(offsets)}) must have the same length")
        self.pool.exclude_unhealthy(f"the weight update to version {version}")
        return await self.pool.call_all(route, {
            "path": str(path), "names": list(names), "dtypes": _dtype_names(dtypes),
            "shapes": _shape_lists(shapes), "offsets": [int(o) for o in offsets],
            "weight_version": str(int(version)), "flush_cache": self.flush_on_load, **({"alias": True} if alias else {}),
        }, timeout=timeout)

    async def update_weights_from_tensor(self, named_tensors: Sequence[tuple[str, torch.Tensor]], version: int | None, *,
                                         flush_cache: bool | None = None, load_format: str | None = None,
                                         timeout: float | None = None) -> dict[str, JsonValue]:
        """Hand ``named_tensors`` to every healthy server by handle (SGLang's
        ``/update_weights_from_tensor``), tagged ``version``.

        Servers on this machine only: CPU tensors travel as shared-memory segment names,
        GPU tensors as CUDA IPC handles (`arealite.utils.tensor_handles`); nothing is copied
        until the server copies into its weights. The tensors must stay unchanged until
        this returns. Every tensor-parallel rank of a server gets the same list (SGLang's
        payload has one entry per rank; each rank loads its own shard of each tensor).
        On SGLang >= 0.5.21 call it between `begin_weight_update` and `end_weight_update`.
        """
        from arealite.utils.tensor_handles import encode_named_tensors

        self.pool.exclude_unhealthy(f"the weight update to version {version}")
        entry = encode_named_tensors(named_tensors)  # once: every server maps the same memory
        flush = self.flush_on_load if flush_cache is None else bool(flush_cache)
        fields: JsonObject = {"flush_cache": flush}
        if version is not None:
            fields["weight_version"] = str(int(version))
        if load_format is not None:
            fields["load_format"] = str(load_format)
        return await self.pool.call_all(
            "/update_weights_from_tensor", timeout=timeout,
            per_server=lambda i, s: {"serialized_named_tensors": [entry] * max(1, s.tp_size), **fields})

    # ------------------------------------------------------------ memory

    async def release_memory_occupation(self, tags: Sequence[str] | None = None, *,
                                        timeout: float | None = None) -> dict[str, JsonValue]:
        """Free every server's memory of kinds ``tags`` (SGLang's names: ``"weights"``,
        ``"kv_cache"``, ``"cuda_graph"``; None: all). Call it paused (`pause_generation`):
        SGLang requires an idle server. The server needs ``--enable-memory-saver``
        (``server.enable_memory_saver``); without it SGLang answers 200 and frees nothing."""
        return await self.pool.call_all("/release_memory_occupation", _tags_body(tags), timeout=timeout)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None, *,
                                       timeout: float | None = None) -> dict[str, JsonValue]:
        """Take back on every server the memory ``release_memory_occupation`` freed (same
        ``tags``). Released weights come back with undefined contents (SGLang without
        ``--enable-weights-cpu-backup``): push weights before generating again."""
        return await self.pool.call_all("/resume_memory_occupation", _tags_body(tags), timeout=timeout)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> dict[str, JsonValue]:
        """Read a weight back from every healthy server: {addr: values (truncated)}."""
        return await self.pool.call_all("/get_weights_by_name", {"name": name, "truncate_size": int(truncate_size)})

    async def score_prompt(self, input_ids: Sequence[int], image_data: Sequence[str] | None = None
                           ) -> dict[str, tuple[list[float], int | None]]:
        """Every healthy server's log-probs of ``input_ids[1:]`` (temperature 1) and the weight
        version it computed them with: ``{addr: (logprobs, version)}``. It generates (one
        token), so the servers must not be paused. ``image_data``: the images of the prompt's
        placeholders (base64, as `GenerationRequest.image_data`)."""
        ids = [int(t) for t in input_ids]
        body = prompt_score_body(ids, f"weight-probe-{uuid.uuid4().hex}")
        if image_data:
            body["image_data"] = list(image_data)
        if self.lora_path:  # a LoRA run: score with the adapter the rollouts use
            body["lora_path"] = self.lora_path
        answers = await self.pool.call_all("/generate", body)
        out, bad = {}, {}
        for addr, data in answers.items():
            try:
                out[addr] = parse_prompt_logprobs(data, ids)
            except ValueError as e:
                bad[addr] = str(e)
        if bad:
            raise ServerAdminError("/generate", bad, out)
        return out

    async def update_weight_version(self, version: int) -> dict[str, JsonValue]:
        """Set the ``weight_version`` every healthy server reports."""
        self.pool.exclude_unhealthy(f"the version update to {version}")
        return await self.pool.call_all(
            "/update_weight_version", {"new_version": str(int(version)), "abort_all_requests": False})

    # ----------------------------------------------------- update sessions

    async def begin_weight_update(self) -> dict[str, JsonValue]:
        """Open a weight-update session on the servers that have them (SGLang >= 0.5.21).

        SGLang refuses a second begin while a session is open (and a distributed update
        outside one), so every begin must be matched by `end_weight_update`, failure or not.
        A server that says a session is already open (left by an earlier, failed trainer)
        has it closed and opened again.
        """
        try:
            return await self._bracket("/begin_weight_update")
        except ServerAdminError as e:
            stale = [a for a, why in e.failures.items() if "already open" in why]
            if not stale or len(stale) < len(e.failures):
                raise
            targets = [self.pool.by_addr[a] for a in stale]
            await self.pool.call_all("/end_weight_update", {}, servers=targets)
            again = await self.pool.call_all("/begin_weight_update", {}, servers=targets)
            return {**e.results, **again}

    async def end_weight_update(self) -> dict[str, JsonValue]:
        """Close the weight-update session on the servers that have them; others skip."""
        return await self._bracket("/end_weight_update")

    def supports_weight_update_brackets(self, addr: str) -> bool:
        """Whether a server has begin/end_weight_update: the routes it lists decide, and
        only a server that lists none is judged by its release."""
        s = self.pool.get(addr)
        served = s.serves("/begin_weight_update")
        return has_weight_update_brackets(s.version) if served is None else served

    async def _bracket(self, route: str) -> dict[str, JsonValue]:
        targets = [s for s in self.pool.states if s.healthy and self.supports_weight_update_brackets(s.addr)]
        if not targets:
            return {}
        return await self.pool.call_all(route, {}, servers=targets)

    # ----------------------------------------------- the weight-update group

    def weights_update_world_size(self) -> int:
        """World size of a weight-update group over the healthy servers (+1 trainer rank)."""
        return 1 + sum(s.tp_size for s in self.pool.states if s.healthy)

    def group_members(self, group_name: str) -> list[str]:
        """The servers that joined weight-update group ``group_name`` (empty if unknown)."""
        return list(self._groups.get(group_name, ()))

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        world_size: int | None = None, group_name: str = "arealite_weights",
                                        backend: str = "gloo", *, timeout: float | None = None) -> dict[str, JsonValue]:
        """Ask every healthy server to join the trainer's weight-update group.

        Rank 0 is the trainer; server i gets ``rank_offset`` 1 + the ranks of the
        servers before it (its ``tp_size`` from ``/get_server_info``, 1 by
        default). The call blocks until the rendezvous: run it as a task while
        the trainer joins the group.
        """
        members = [s for s in self.pool.states if s.healthy]
        expected = 1 + sum(s.tp_size for s in members)
        if world_size is None:
            world_size = expected
        elif int(world_size) != expected:
            raise ValueError(
                f"init_weights_update_group: world_size={world_size}, but the "
                f"{len(members)} healthy server(s) hold {expected - 1} rank(s) plus 1 trainer "
                f"rank = {expected}; pass world_size={expected} (or None)")
        offsets, nxt = [], 1
        for s in members:
            offsets.append(nxt)
            nxt += s.tp_size
        self.pool.exclude_unhealthy(f"weight-update group {group_name!r}")
        self._groups[group_name] = [s.addr for s in members]
        return await self.pool.call_all(
            "/init_weights_update_group", servers=members, timeout=timeout,
            per_server=lambda i, s: {
                "master_address": master_address, "master_port": int(master_port),
                "rank_offset": offsets[i], "world_size": int(world_size),
                "group_name": group_name, "backend": backend,
            })

    def _members(self, group_name: str, route: str) -> list[ServerState]:
        if group_name not in self._groups:
            raise ValueError(
                f"{route}: unknown weight-update group {group_name!r} "
                f"(known: {sorted(self._groups)}); call init_weights_update_group first")
        members = [self.pool.by_addr[a] for a in self._groups[group_name]]
        gone = [s for s in members if not s.healthy]
        if gone:
            # A collective with a dead member would hang: fail clearly instead.
            raise ServerAdminError(
                route, {s.addr: f"out of rotation ({s.reason}); group {group_name!r} is broken, "
                        "destroy and re-create it" for s in gone}, {})
        return members

    async def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[torch.dtype | str], shapes: Sequence[Sequence[int]],
        group_name: str = "arealite_weights", version: int | None = None, flattened_bucket: bool = False,
        *, flush_cache: bool | None = None, timeout: float | None = None,
    ) -> dict[str, JsonValue]:
        """Tell every group member to receive the tensors ``names`` (broadcast from rank 0).

        ``dtypes`` may be torch dtypes or strings ("bfloat16"). Post this while
        the trainer broadcasts, in ``names`` order.
        """
        route = "/update_weights_from_distributed"
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"{route}: names ({len(names)}), dtypes ({len(dtypes)}) and shapes "
                             f"({len(shapes)}) must have the same length")
        members = self._members(group_name, route)
        payload: JsonObject = {
            "names": list(names), "dtypes": _dtype_names(dtypes), "shapes": _shape_lists(shapes),
            "group_name": group_name,
            "flush_cache": self.flush_on_load if flush_cache is None else bool(flush_cache),
        }
        if version is not None:
            payload["weight_version"] = str(int(version))
        if flattened_bucket:
            payload["load_format"] = "flattened_bucket"
        return await self.pool.call_all(route, payload, servers=members, timeout=timeout)

    async def destroy_weights_update_group(self, group_name: str = "arealite_weights") -> dict[str, JsonValue]:
        """Tear down a weight-update group on its (healthy) members."""
        addrs = self._groups.pop(group_name, None)
        if addrs is None:
            raise ValueError(f"destroy_weights_update_group: unknown group {group_name!r} "
                             f"(known: {sorted(self._groups)})")
        members = [self.pool.by_addr[a] for a in addrs if self.pool.by_addr[a].healthy]
        if not members:
            return {}
        return await self.pool.call_all("/destroy_weights_update_group", {"group_name": group_name},
                                        servers=members)


def _tags_body(tags: Sequence[str] | None) -> JsonObject:
    if tags is None:
        return {}
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise TypeError(f"tags must be a sequence of strings such as ['weights', 'kv_cache'], got {tags!r}")
    return {"tags": list(tags)}


def _adapter_missing(why: str) -> bool:
    """Whether an unload failed only because the server does not hold the adapter (SGLang's
    ``LoRARegistry.unregister``: "LoRA with name X does not exist")."""
    return why.startswith("HTTP 400") and "does not exist" in why
