"""Continuous batching of a Hugging Face causal LM on a dedicated thread.

One background thread owns the model. Its loop, between two decode steps:
runs queued commands (weight loads, pause, abort...), admits waiting requests
(one prefill forward for all of them, merged into the running batch), then
advances every running sequence by one token with a single forward over a
shared KV cache. The event loop only queues work and awaits futures, so HTTP
stays responsive while the model computes.

Batch layout: the KV cache (HF ``DynamicCache``) is left-padded to a common
length ``T``; ``mask [B, T]`` marks each row's real cached tokens, and each row
keeps its own position (its count of real tokens), so rotary embeddings see
exactly the positions of an unpadded forward. Sequences join by padding the
shorter cache on the left and leave by dropping their row; columns that became
padding in every row are trimmed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Callable, TypeVar

import torch
import torch.nn.functional as F

from arealite.utils.json_types import JsonObject

from arealite.moe.router_hooks import RoutingCapture

from .prompt_cache import PromptCache, cached_row, stack_cached
from .generate_request import GenerateInput
from .runner_contract import PauseState, Sequence, record_version_change
from .sampling import BatchSamplingState, sample_rows
from .vision import prefill_inputs, prompt_key, rope_deltas

logger = logging.getLogger("arealite.server")

T = TypeVar("T")


def _deliver(fut: asyncio.Future, value: object = None, error: BaseException | None = None) -> None:
    # Runs on the event loop: the request may have been cancelled meanwhile.
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


def _input_logprobs(seqs: list[Sequence], logits: torch.Tensor, ids: torch.Tensor, lens: list[int]) -> None:
    """SGLang's ``input_token_logprobs`` for the sequences that asked (``logprob_start_len``).

    Entry j is the log-prob (temperature 1) of prompt token ``start + j`` given the tokens
    before it; entry 0 is None, as SGLang reports it (``[None] + logprobs[:-1]``).
    """
    T = ids.shape[1]
    for i, s in enumerate(seqs):
        start = s.inp.logprob_start_len
        if start < 0:
            continue
        off = T - lens[i]  # left padding
        rows = logits[i, off + start:T - 1].float().log_softmax(-1)
        nxt = ids[i, off + start + 1:T]
        s.input_logprobs = [None] + rows.gather(-1, nxt[:, None]).squeeze(-1).tolist()


def _routing_of(capture: RoutingCapture | None, seqs, shape: torch.Size) -> torch.Tensor | None:
    """The last forward's routed experts ``[B, T, layers, k]`` on the CPU, when a sequence asked."""
    if capture is None or not any(s.inp.return_routed_experts for s in seqs):
        return None
    return capture.take().cpu().view(*shape, capture.n_layers, capture.top_k)


def _keep_routing(seqs: list[Sequence], routing: torch.Tensor | None, starts: list[int]) -> None:
    """Append to each asking sequence its rows of ``routing``, from its first real column."""
    if routing is None:
        return
    for i, s in enumerate(seqs):
        if s.inp.return_routed_experts:
            s.routed_experts.append(routing[i, starts[i]:])


def _prompt_key(s: Sequence) -> tuple:
    """What a prompt's KV cache depends on besides the weights: its adapter, images and ids."""
    return (id(s.inp.lora), prompt_key(s.inp), *s.inp.input_ids)


def _shared_prompts(seqs: list[Sequence]) -> tuple[list[Sequence], list[int] | None]:
    """The sequences with distinct prompts (and adapters), and for each of ``seqs`` the index
    of the one whose prompt it shares; None when every prompt is distinct. A sequence that
    shares another's prompt gets its ``cached_tokens``."""
    first: dict[tuple, int] = {}
    uniq: list[Sequence] = []
    src: list[int] = []
    for s in seqs:
        key = _prompt_key(s)
        j = first.get(key)
        if j is None:
            j = first[key] = len(uniq)
            uniq.append(s)
        else:
            s.cached_tokens = len(s.inp.input_ids) - 1
        src.append(j)
    return (seqs, None) if len(uniq) == len(seqs) else (uniq, src)


class ModelRunner:
    """Owns the model and serves generation requests with continuous batching."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device, eos_ids: set[int], pad_id: int,
                 vocab_size: int, max_batch_size: int, random_seed: int, weight_version: str,
                 prompt_cache_entries: int = 0, capture_routing: bool = False):
        self.model = model
        self.device = device
        self.eos_ids = frozenset(eos_ids)
        self.pad_id = pad_id
        self.vocab_size = vocab_size
        self.max_batch_size = max_batch_size
        self.weight_version = self._served_version = weight_version  # the second: as the live sequences know it
        self.shared_gen = torch.Generator(device=device)
        self.shared_gen.manual_seed(random_seed)

        self._cv = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._commands: deque[tuple[Callable[[], object], asyncio.Future, asyncio.AbstractEventLoop]] = deque()
        self._stop = False
        self.pause = PauseState()  # admission held while paused or in a weight-update bracket

        self._running: list[Sequence] = []
        self._cache = None
        self._mask: torch.Tensor | None = None  # [B, T] int64
        self._positions: torch.Tensor | None = None  # [B] position of the pending token
        self._next: torch.Tensor | None = None  # [B] sampled, not yet in the cache
        self._sampling: BatchSamplingState | None = None
        self.stats = {"steps": 0, "prefills": 0, "shared_prefill_rows": 0, "prompt_cache_rows": 0,
                      "generated_tokens": 0, "max_running": 0}
        # Prompts' KV caches kept between admissions; cleared after any command (see `_main`).
        self.prompt_cache = PromptCache(prompt_cache_entries)
        self.lora = None  # the server's LoRA adapters (`arealite.server.lora_adapters.LoraSet`), set by its routes
        # --enable-return-routed-experts: hooks on the MoE routers, read by `_routing_of`.
        self.routing = RoutingCapture(model).__enter__() if capture_routing else None
        self._last_routing: torch.Tensor | None = None  # the last forward's, when asked for

        self._thread = threading.Thread(target=self._main, name="arealite-model", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------
    # Event-loop side
    # ------------------------------------------------------------------

    async def generate(self, inp: GenerateInput) -> Sequence:
        """Queue one sequence and wait for it to finish (or be aborted)."""
        loop = asyncio.get_running_loop()
        gen = None
        if inp.sampling.sampling_seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(inp.sampling.sampling_seed)
        # As SGLang's Req.check_finished: ignore_eos turns off every token stop,
        # stop_token_ids included; only max_new_tokens (or an abort) ends the sequence.
        stop = set() if inp.sampling.ignore_eos else set(inp.sampling.stop_token_ids) | self.eos_ids
        seq = Sequence(inp=inp, future=loop.create_future(), loop=loop, stop_ids=frozenset(stop), generator=gen)
        with self._cv:
            if self._stop:
                raise RuntimeError("the model runner is shut down")
            self._waiting.append(seq)
            self._cv.notify()
        try:
            return await seq.future
        except asyncio.CancelledError:
            # The client left (or its handler was cancelled): free the batch row now,
            # not after max_new_tokens more steps nobody will read.
            self._queue_command(lambda: self._abort(lambda s: s is seq, "the client disconnected", waiting=True))
            raise

    def _queue_command(self, fn: Callable[[], object]) -> None:
        """Queue ``fn`` for the model thread without waiting for it."""
        loop = asyncio.get_running_loop()
        with self._cv:
            if not self._stop:
                self._commands.append((fn, loop.create_future(), loop))
                self._cv.notify()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the model thread between two steps and return its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            if self._stop:
                raise RuntimeError("the model runner is shut down")
            self._commands.append((fn, fut, loop))
            self._cv.notify()
        return await fut

    def shutdown(self) -> None:
        """Stop the thread; unfinished requests are aborted."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    # Commands (run on the model thread through ``call``).

    def set_paused(self, paused: bool, mode: str = "abort") -> int:
        """Pause admission (and abort or freeze running sequences); returns how many were running."""
        return self.pause.set(self, paused, mode)

    def abort(self, rid_prefix: str | None, message: str) -> int:
        """Abort running and waiting requests whose rid starts with the prefix (all when None)."""
        return self._abort(lambda s: rid_prefix is None or s.inp.rid.startswith(rid_prefix), message, waiting=True)

    def retract_running(self) -> int:
        """Put the running sequences back at the head of the queue, their KV dropped."""
        seqs = self._running
        self._reset_batch()
        with self._cv:
            self._waiting.extendleft(reversed(seqs))
        return len(seqs)

    # ------------------------------------------------------------------
    # Model thread
    # ------------------------------------------------------------------

    def _frozen(self) -> bool:
        return self.pause.freezes_running

    def _can_admit(self) -> bool:
        return bool(self._waiting) and self.pause.admits and len(self._running) < self.max_batch_size

    def _main(self) -> None:
        torch.set_grad_enabled(False)  # per thread
        while True:
            with self._cv:
                while not (self._stop or self._commands or self._can_admit()
                           or (self._running and not self._frozen())):
                    self._cv.wait()
                if self._stop:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for fn, fut, loop in commands:
                try:
                    result, error = fn(), None
                except Exception as e:  # reported to the caller, never kills the loop
                    result, error = None, e
                loop.call_soon_threadsafe(_deliver, fut, result, error)
            if commands:  # weights and adapters change only through commands: no stale prompt KV
                self.prompt_cache.clear()
            admit: list[Sequence] = []
            try:
                with self._cv:
                    if self.weight_version != self._served_version:  # new weights under the live sequences
                        record_version_change([(s, len(s.output_ids)) for s in self._running + list(self._waiting)],
                                              self._served_version)
                        self._served_version = self.weight_version
                    if not self._running and self._can_admit():
                        self._coalesce_arrivals()
                    while self._can_admit() and len(self._running) + len(admit) < self.max_batch_size:
                        admit.append(self._waiting.popleft())
                if admit:
                    self._prefill(admit)
                if self._running and not self._frozen():
                    self._decode_step()
            except Exception as e:  # a failed forward fails the batch, not the server
                logger.exception("generation step failed; failing %d running requests", len(self._running))
                failed = self._running + [s for s in admit if s not in self._running]
                self._reset_batch()
                for s in failed:
                    s.loop.call_soon_threadsafe(_deliver, s.future, None, RuntimeError(f"generation failed: {e}"))
        # Shut down: abort whatever is left so no client waits forever.
        self._abort(lambda s: True, "server shutting down", waiting=True)
        with self._cv:
            for fn, fut, loop in self._commands:
                loop.call_soon_threadsafe(_deliver, fut, None, RuntimeError("server shutting down"))
            self._commands.clear()

    def _coalesce_arrivals(self, quiet_s: float = 0.002, max_wait_s: float = 0.02) -> None:
        """When idle, let a burst of concurrent requests arrive so they share one prefill: with the
        lock held, wait until none arrived for ``quiet_s`` (at most ``max_wait_s``)."""
        deadline = time.perf_counter() + max_wait_s
        n = len(self._waiting)
        while n < self.max_batch_size and not self._commands and time.perf_counter() < deadline:
            self._cv.wait(quiet_s)
            if len(self._waiting) == n:
                break
            n = len(self._waiting)

    def _reset_batch(self) -> None:
        self._running = []
        self._cache = self._mask = self._positions = self._next = self._sampling = None

    def _finish(self, seq: Sequence, reason: JsonObject) -> None:
        seq.finish_reason = reason
        seq.weight_version = self.weight_version
        seq.end_time = time.perf_counter()
        seq.loop.call_soon_threadsafe(_deliver, seq.future, seq)

    def _forward(self, input_ids, mask, positions, cache, all_positions: bool = False, seqs=(), extra=None):
        if self.lora is not None:  # the adapter of each row (`lora_path`)
            self.lora.select([s.inp.lora for s in seqs])
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=0 if all_positions else 1,
                         **(extra or {}))  # images: `arealite.server.vision.prefill_inputs`
        self._last_routing = _routing_of(self.routing, seqs, input_ids.shape)
        return out.logits if all_positions else out.logits[:, -1, :]

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Run the prompts of newly admitted sequences and merge them into the batch."""
        ready = []
        for s in seqs:
            if s.inp.sampling.max_new_tokens == 0:
                self._finish(s, {"type": "length", "length": 0})
            else:
                ready.append(s)
        if not ready:
            return
        resumed = [s for s in ready if s.output_ids]
        if resumed:  # retracted by a pause: prompt + output so far, under the current weights
            ready = [s for s in ready if not s.output_ids]
            self._join(resumed, *self._run_prompts(resumed, False, resume=True))
            if not ready:
                return
        want_input = any(s.inp.logprob_start_len >= 0 for s in ready)
        exact = want_input or any(s.inp.return_routed_experts for s in ready)
        # Samples of one prompt (a GRPO group) arrive together: their prompt runs once and its
        # cache is copied to each (reported as cached_tokens, capped at the prompt less one
        # token as SGLang caps a prefix-cache hit). Not when prompt log-probs or routing are asked for.
        uniq, src = (ready, None) if exact else _shared_prompts(ready)
        cache, logits, mask, lens = self._prompt_states(uniq, want_input, exact)
        if src is not None:
            idx = torch.tensor(src, dtype=torch.long, device=self.device)
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys.index_select(0, idx), layer.values.index_select(0, idx)
            logits, mask = logits.index_select(0, idx), mask.index_select(0, idx)
            lens = [lens[j] for j in src]
            self.stats["shared_prefill_rows"] += len(ready) - len(uniq)
        self._join(ready, cache, logits, mask, lens)

    def _join(self, seqs: list[Sequence], cache, logits: torch.Tensor, mask: torch.Tensor, lens: list[int]) -> None:
        """Merge prefilled sequences into the batch and sample their next token."""
        b_old = len(self._running)
        # Decode positions: a row's length plus its rope delta (0 but for rows with images).
        self._merge(seqs, cache, mask, torch.tensor(lens, device=self.device)
                    + torch.tensor(rope_deltas(seqs), device=self.device))
        state = BatchSamplingState.build([s.inp.sampling for s in seqs], [s.generator for s in seqs],
                                         self.vocab_size, self.device)
        tokens, logprobs, top = sample_rows(logits, state, self.shared_gen, max(s.inp.top_logprobs_num for s in seqs))
        self._next[b_old:] = tokens
        self._record(range(b_old, b_old + len(seqs)), tokens.tolist(), logprobs.tolist(), top)

    def _prompt_states(self, seqs: list[Sequence], want_input: bool, exact: bool):
        """Cache, last logits ``[B, vocab]``, mask and lengths of the distinct prompts ``seqs``:
        those in the prompt cache are copied from it (their ``cached_tokens`` set), the others
        run in one forward and are cached for the next admission. ``exact``: all of them run."""
        use_cache = self.prompt_cache.enabled and not exact
        keys = [_prompt_key(s) for s in seqs] if use_cache else []
        found = [self.prompt_cache.get(k) for k in keys] if use_cache else [None] * len(seqs)
        todo = [i for i, e in enumerate(found) if e is None]
        n_hits = len(seqs) - len(todo)
        for s, e in zip(seqs, found):
            if e is not None:
                s.cached_tokens = e.n_tokens - 1
        self.stats["prompt_cache_rows"] += n_hits
        if todo:
            cache, logits, mask, lens = self._run_prompts([seqs[i] for i in todo], want_input)
            if use_cache:
                for j, i in enumerate(todo):
                    found[i] = cached_row(cache.layers, logits, j, lens[j])
                    self.prompt_cache.put(keys[i], found[i])
            if not n_hits:
                return cache, logits, mask, lens
        return stack_cached(found, self.device)

    def _run_prompts(self, seqs: list[Sequence], want_input: bool, resume: bool = False):
        """One forward over the prompts of ``seqs`` (``resume``: and their output so far), left-padded:
        (cache, last logits, mask, lengths)."""
        from transformers import DynamicCache

        rows = [list(s.inp.input_ids) + s.output_ids if resume else s.inp.input_ids for s in seqs]
        lens = [len(r) for r in rows]
        T = max(lens)
        ids = torch.full((len(seqs), T), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), T), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, T - lens[i]:] = torch.tensor(row, dtype=torch.long)
            mask[i, T - lens[i]:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        positions, extra = prefill_inputs(seqs, positions, lens, self.model.dtype)
        cache = DynamicCache()
        logits = self._forward(ids, mask, positions, cache, all_positions=want_input, seqs=seqs, extra=extra)
        if want_input:
            _input_logprobs(seqs, logits, ids, lens)
            logits = logits[:, -1, :]
        if not resume:  # a resumed sequence's routing rows were kept at its first prefill
            _keep_routing(seqs, self._last_routing, [T - n for n in lens])
        self.stats["prefills"] += 1
        return cache, logits, mask, lens

    def _merge(self, seqs: list[Sequence], cache, mask: torch.Tensor, positions: torch.Tensor) -> None:
        if not self._running:
            self._running = list(seqs)
            self._cache, self._mask, self._positions = cache, mask, positions
            self._next = torch.zeros(len(seqs), dtype=torch.long, device=self.device)
        else:
            t_old, t_new = self._mask.shape[1], mask.shape[1]
            T = max(t_old, t_new)
            for old_layer, new_layer in zip(self._cache.layers, cache.layers):
                # KV tensors are [B, heads, T, head_dim]: pad the time axis on the left.
                old_layer.keys = torch.cat([F.pad(old_layer.keys, (0, 0, T - t_old, 0)),
                                            F.pad(new_layer.keys, (0, 0, T - t_new, 0))])
                old_layer.values = torch.cat([F.pad(old_layer.values, (0, 0, T - t_old, 0)),
                                              F.pad(new_layer.values, (0, 0, T - t_new, 0))])
            self._mask = torch.cat([F.pad(self._mask, (T - t_old, 0)), F.pad(mask, (T - t_new, 0))])
            self._positions = torch.cat([self._positions, positions])
            self._next = torch.cat([self._next, torch.zeros(len(seqs), dtype=torch.long, device=self.device)])
            self._running.extend(seqs)
        self.stats["max_running"] = max(self.stats["max_running"], len(self._running))
        self._rebuild_sampling()

    def _rebuild_sampling(self) -> None:
        self._sampling = BatchSamplingState.build(
            [s.inp.sampling for s in self._running], [s.generator for s in self._running],
            self.vocab_size, self.device,
        ) if self._running else None

    def _decode_step(self) -> None:
        B = len(self._running)
        self._mask = torch.cat([self._mask, torch.ones((B, 1), dtype=self._mask.dtype, device=self.device)], dim=1)
        logits = self._forward(self._next[:, None], self._mask, self._positions[:, None], self._cache,
                               seqs=self._running)
        self._positions = self._positions + 1
        _keep_routing(self._running, self._last_routing, [0] * B)
        tokens, logprobs, top = sample_rows(logits, self._sampling, self.shared_gen,
                                            max(s.inp.top_logprobs_num for s in self._running))
        self._next = tokens
        self.stats["steps"] += 1
        self._record(range(B), tokens.tolist(), logprobs.tolist(), top)

    def _record(self, rows: range, tokens: list[int], logprobs: list[float], top=None) -> None:
        """Append each row's new token; finish rows that hit a stop token or their length."""
        done = []
        for j, i in enumerate(rows):
            s = self._running[i]
            t = tokens[j]
            s.output_ids.append(t)
            s.output_logprobs.append(logprobs[j])
            k = s.inp.top_logprobs_num
            if k and top is not None:
                if s.output_top_logprobs is None:
                    s.output_top_logprobs = []
                s.output_top_logprobs.append([[v, x, None] for v, x in zip(top[0][j][:k], top[1][j][:k])])
            if t in s.stop_ids:
                done.append(i)
                self._finish(s, {"type": "stop", "matched": t})
            elif len(s.output_ids) >= s.inp.sampling.max_new_tokens:
                done.append(i)
                self._finish(s, {"type": "length", "length": s.inp.sampling.max_new_tokens})
        self.stats["generated_tokens"] += len(tokens)
        if done:
            self._drop_rows(set(done))

    def _drop_rows(self, drop: set[int]) -> None:
        keep = [i for i in range(len(self._running)) if i not in drop]
        if not keep:
            self._reset_batch()
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self._mask.index_select(0, idx)
        # Columns that are padding in every remaining row carry nothing: trim them.
        lead = int((mask.cumsum(dim=1) == 0).sum(dim=1).min())
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, idx)[:, :, lead:]
            layer.values = layer.values.index_select(0, idx)[:, :, lead:]
        self._mask = mask[:, lead:]
        self._positions = self._positions.index_select(0, idx)
        self._next = self._next.index_select(0, idx)
        self._running = [self._running[i] for i in keep]
        self._rebuild_sampling()

    def _abort(self, pred: Callable[[Sequence], bool], message: str, waiting: bool) -> int:
        n = 0
        reason = {"type": "abort", "message": message}
        if waiting:
            with self._cv:
                keep = deque()
                for s in self._waiting:
                    if pred(s):
                        self._finish(s, dict(reason))
                        n += 1
                    else:
                        keep.append(s)
                self._waiting = keep
        rows = {i for i, s in enumerate(self._running) if pred(s)}
        for i in rows:
            self._finish(self._running[i], dict(reason))
        if rows:
            self._drop_rows(rows)
        return n + len(rows)

    @property
    def n_running(self) -> int:
        return len(self._running)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)
