"""`AsyncLLM`: the engine loop on its own thread, driven from an asyncio event loop.

In the spirit of vLLM's `AsyncLLM`, in one process: the **engine thread** is the only thread that
touches the `LLM` (scheduler, runner, batch queue). The event loop talks to it through one
thread-safe command queue (`AddCommand`, `AbortCommand`, `StopCommand`, applied in order between
steps) and hears back once per loop turn: an `EngineTurn` is handed to the loop with
`call_soon_threadsafe`, which routes its deltas into per-request asyncio queues (`RequestStream`).

Every wait is bounded by an event that always comes: a request's stream ends with its finishing
delta, with an abort, or, when the engine dies, with an error (`EngineDeadError`); then the
`on_dead` callbacks run on the loop (the server exits).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from neuron_async_sm.engine.core import EngineDeadError
from neuron_async_sm.engine.llm import LLM
from neuron_async_sm.outputs import RequestDelta
from neuron_async_sm.sampling_params import InvalidRequestError, SamplingParams, child_request_id

logger = logging.getLogger("neuron_async_sm")

IDLE_POLL_S = 0.5  # an idle engine thread re-checks its queue this often (shutdown always wakes it at once)


class EngineOverloadedError(RuntimeError):
    """More requests wait than `max_waiting` allows: refused at once (HTTP 503), never queued."""


@dataclass(frozen=True)
class AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_s: float  # time.monotonic() when the front end received it (TTFT and latency start here)


@dataclass(frozen=True)
class AbortCommand:
    request_id: str
    # What the request's finishing delta says (metrics count it so): "abort", or "stop" when the front
    # end found a stop string in the text, which the engine cannot see.
    finish_reason: str = "abort"


@dataclass(frozen=True)
class StopCommand:
    """Abort whatever is still open, close the engine, end the thread."""


Command = AddCommand | AbortCommand | StopCommand


@dataclass(frozen=True)
class EngineStats:
    """What the engine thread read off the engine after a turn (the loop side never reads the engine)."""

    num_running: int  # requests holding a KV slot
    num_waiting: int  # requests queued for a slot
    num_free_slots: int  # KV slots nobody holds (max_num_seqs at idle, unless one leaked)
    num_tracked: int  # requests the scheduler still tracks (0 at idle, unless one leaked)
    num_steps: int  # forward steps enqueued since the engine started
    sync_steps: int  # sync mode: every forward step (there is no machine); 0 in async mode


@dataclass(frozen=True)
class EngineTurn:
    """One turn of the engine thread, as the event loop and the observers see it."""

    accepted: list[str]  # adds the scheduler took this turn
    rejected: dict[str, str]  # request id -> InvalidRequestError message (names the field)
    arrivals: dict[str, tuple[int, float]]  # accepted id -> (prompt tokens, arrival_s)
    scheduled: dict[str, float]  # id -> time.monotonic() before the step that first scheduled it (left the queue)
    deltas: list[RequestDelta]  # the step's deltas and the aborts' finishing deltas, in order
    now_s: float  # time.monotonic() when the turn's deltas were known
    stats: EngineStats
    dead_reason: str | None = None  # set on the turn the engine died (every open request failed with it)


@dataclass
class RequestStream:
    """One request's deltas on the event loop. Owned by the loop thread only."""

    request_id: str
    accepted: asyncio.Future  # resolves once the engine thread took (or rejected) the add
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        """The request's deltas until (and including) the one that finishes it."""
        while True:
            delta: RequestDelta = await self.deltas.get()
            yield delta
            if delta.finish_reason is not None:
                return


class AsyncLLM:
    """Asyncio front end over one `LLM`: `await add_request()`, iterate the stream, `abort()`
    (`add_parallel_request()`: n sequences of one prompt, a stream each).

    `observers` are called on the engine thread after each turn with the `EngineTurn` (metrics);
    the engine's own tracer is how they see step-level events.
    """

    def __init__(
        self,
        llm: LLM,
        *,
        max_waiting: int | None = None,
        observers: tuple[Callable[[EngineTurn], None], ...] = (),
        owns_llm: bool = True,
    ) -> None:
        self.llm = llm
        self.owns_llm = owns_llm  # the engine thread closes the LLM when it ends (False: the caller does)
        self.max_waiting = max_waiting
        self._observers = observers
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = False  # the engine thread was started (it closes the LLM when it ends)
        self.dead_reason: str | None = None  # loop thread only
        self.stopped = False  # loop thread only
        self.last_stats: EngineStats | None = None  # loop thread only
        self.on_dead: list[Callable[[str], None]] = []  # called on the loop, once, when the engine died

    # -- event-loop side ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._engine_loop, name="engine", daemon=True)
        self._started = True
        self._thread.start()

    @property
    def num_open(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Open requests beyond the KV slots: those that must wait once the scheduler has filled every slot.

        Not `open - running`: `running` is as of the last turn, so a burst arriving before the engine
        thread's next schedule would count as waiting and be refused while slots are free.
        """
        return max(0, len(self._streams) - self.llm.config.max_num_seqs)

    async def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Hand a request to the engine; returns once the scheduler accepted it.

        Raises InvalidRequestError (the scheduler's, naming the field), EngineOverloadedError (more
        than max_waiting wait) or EngineDeadError, before any token is generated.
        """
        self._check_open()
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise EngineOverloadedError(f"{self.num_waiting} requests are waiting (--max-waiting {self.max_waiting})")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise InvalidRequestError(f"request_id: duplicate request id {request_id!r}")
        assert self._loop is not None, "AsyncLLM.start() was not called"
        stream = RequestStream(request_id, self._loop.create_future())
        self._streams[request_id] = stream
        self._commands.put(AddCommand(request_id, list(prompt_token_ids), params, time.monotonic()))
        try:
            await stream.accepted
        except asyncio.CancelledError:
            # The client left before the engine thread took the add: it must not run unseen.
            self.abort(request_id)
            raise
        return stream

    async def add_parallel_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> list[RequestStream]:
        """`params.n` sequences of one prompt, as n child requests (`params.children()`: child i seeded
        `seed + i`, id `"{i}_{request_id}"`); their streams in child order, each ending on its own.

        All or none: if one child is refused, the children already added are aborted and the refusal raised.
        """
        children = params.children()
        if len(children) == 1:
            return [await self.add_request(prompt_token_ids, params, request_id)]
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        streams: list[RequestStream] = []
        try:
            for index, child in enumerate(children):
                streams.append(await self.add_request(prompt_token_ids, child, child_request_id(request_id, index)))
        except BaseException:
            for stream in streams:
                self.abort(stream.request_id)
            raise
        return streams

    def abort(self, request_id: str, finish_reason: str = "abort") -> None:
        """Nobody listens any more: drop the stream now, abort the request on the engine thread.

        A no-op for a request that already finished. `finish_reason="stop"`: it ended on a stop string.
        """
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            stream.finished = True
            self._commands.put(AbortCommand(request_id, finish_reason))

    def abort_all(self) -> None:
        """Server-initiated (shutdown deadline): every open request ends with an `abort` delta."""
        for request_id in list(self._streams):
            self._commands.put(AbortCommand(request_id))

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort what is open, stop the engine thread and close the engine; bounded by `timeout_s`."""
        if self._thread is None:
            return
        self._commands.put(StopCommand())
        thread, self._thread = self._thread, None
        await asyncio.to_thread(thread.join, timeout_s)
        if thread.is_alive():
            logger.warning("engine thread did not stop within %.0f s", timeout_s)
        self.stopped = True
        self._fail_open("the server is shutting down")

    def close(self) -> None:
        """Blocking and idempotent, for after the event loop is gone: the engine is closed exactly once."""
        if self._thread is not None:
            self._commands.put(StopCommand())
            self._thread.join(timeout=30)
            self._thread = None
        elif not self._started and self.owns_llm:
            self.llm.close()
        self._started = self.stopped = True

    def _check_open(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_reason}")
        if self.stopped or self._thread is None:
            raise EngineDeadError("engine is not running")

    def _on_turn(self, turn: EngineTurn) -> None:
        """On the loop: route one turn's acks and deltas to their streams."""
        self.last_stats = turn.stats
        for request_id in turn.accepted:
            stream = self._streams.get(request_id)
            if stream is not None and not stream.accepted.done():
                stream.accepted.set_result(None)
        for request_id, message in turn.rejected.items():
            stream = self._streams.pop(request_id, None)
            if stream is not None and not stream.accepted.done():
                stream.accepted.set_exception(InvalidRequestError(message))
        for delta in turn.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue  # aborted by its client: nobody listens
            stream.deltas.put_nowait(delta)
            if delta.finish_reason is not None:
                stream.finished = True
                del self._streams[delta.request_id]
        if turn.dead_reason is not None and self.dead_reason is None:
            self.dead_reason = turn.dead_reason
            self._fail_open(turn.dead_reason)
            for callback in self.on_dead:
                callback(turn.dead_reason)

    def _fail_open(self, reason: str) -> None:
        """End every open stream with an error (an add still queued included): nobody waits forever."""
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            if not stream.accepted.done():
                stream.accepted.set_exception(EngineDeadError(f"engine is dead: {reason}"))
            stream.deltas.put_nowait(RequestDelta(stream.request_id, [], "error", reason))

    # -- engine thread ------------------------------------------------------------------------------

    def _engine_loop(self) -> None:
        """Apply queued commands, step while work is unfinished, post one `EngineTurn` per turn.

        Blocks on the command queue only when idle. A failure of the engine ends every request with an
        error (the engine's own `fail_all`), then the thread posts the reason and stops.
        """
        llm = self.llm
        stopping = False
        dead_reason: str | None = None
        while not stopping and dead_reason is None:
            accepted: list[str] = []
            rejected: dict[str, str] = {}
            arrivals: dict[str, tuple[int, float]] = {}
            scheduled: dict[str, float] = {}
            deltas: list[RequestDelta] = []
            try:
                for command in self._take_commands(block=not llm.has_unfinished_requests()):
                    if isinstance(command, AddCommand):
                        try:
                            llm.add_request(command.prompt_token_ids, command.sampling_params, command.request_id)
                        except InvalidRequestError as exc:
                            rejected[command.request_id] = str(exc)
                            continue
                        accepted.append(command.request_id)
                        arrivals[command.request_id] = (len(command.prompt_token_ids), command.arrival_s)
                    elif isinstance(command, AbortCommand):
                        # Wherever it is: waiting, in a step on the device, or being materialized; the
                        # scheduler discards the tokens its in-flight steps still produce.
                        delta = llm.abort(command.request_id)
                        if delta is not None:
                            deltas.append(replace(delta, finish_reason=command.finish_reason))
                    else:
                        stopping = True
                if stopping:
                    deltas.extend(d for rid in self._unfinished_ids() if (d := llm.abort(rid)) is not None)
                elif llm.has_unfinished_requests():
                    waiting = llm.engine.scheduler.waiting
                    queued = {r.request_id for r in waiting} if waiting else ()
                    before_s = time.monotonic()
                    deltas.extend(llm.step())  # a device failure comes back as "error" deltas
                    if queued:
                        scheduled = dict.fromkeys(queued - {r.request_id for r in waiting}, before_s)
                dead_reason = llm.engine.dead_reason
            except Exception as exc:  # a bug or a dead engine: never leave the loop side waiting
                logger.exception("engine thread failed")
                dead_reason = llm.engine.dead_reason or f"{type(exc).__name__}: {exc}"
            if accepted or rejected or scheduled or deltas or dead_reason is not None or stopping:
                now_s = time.monotonic()
                self._post(
                    EngineTurn(accepted, rejected, arrivals, scheduled, deltas, now_s, self._stats(), dead_reason)
                )
        if self.owns_llm:
            try:
                llm.close()
            except Exception:
                logger.exception("engine shutdown failed")

    def _take_commands(self, *, block: bool) -> list[Command]:
        commands: list[Command] = []
        if block:
            try:
                commands.append(self._commands.get(timeout=IDLE_POLL_S))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _unfinished_ids(self) -> list[str]:
        scheduler = self.llm.engine.scheduler
        return [r.request_id for r in scheduler.requests.values() if not r.is_finished]

    def _stats(self) -> EngineStats:
        engine = self.llm.engine
        scheduler = engine.scheduler
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_free_slots=scheduler.num_free_slots,
            num_tracked=len(scheduler.requests),
            num_steps=engine.num_steps,
            sync_steps=0 if engine.config.async_scheduling else engine.num_steps,
        )

    def _post(self, turn: EngineTurn) -> None:
        for observer in self._observers:
            try:
                observer(turn)
            except Exception:  # metrics must never take the engine down
                logger.exception("engine observer failed")
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._on_turn, turn)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass
