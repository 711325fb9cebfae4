"""A member's side of the durable work queue: queued jobs run once, repeats are absorbed.

The memory hands each queued job to one member of its cluster as a JOB frame (a request whose
payload starts with the job's 16-byte id). The memory forgets a job once it has the member's
answer; an answer lost on the way (the dispatcher died, the link dropped) makes it hand the job
out again. A member that already answered that job id answers the repeat from what it answered
then, without running the handler again, and one that is still running it answers the repeat
with the same outcome when it ends: the idempotency window, counted as `jobs_absorbed`. A
repeat that reaches another member (the first one died mid-job) runs again there: delivery is
at least once, and the memory counts each job it hands out again as `jobs_redelivered`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from irismesh._core.events import RequestArrived, RequestCancelled, Token
from irismesh._core.frames import MESSAGE_ID_SIZE
from irismesh.errors import ProtocolError
from irismesh.patterns.reqrep import HandlerRunner, RequestHandler

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

# The window: answers to the last jobs this member ran, for repeats. Bounded by count and by
# bytes (an answer larger than a quarter of the byte bound is not kept: its repeat runs again).
WINDOW_JOBS = 4096
WINDOW_BYTES = 16 * 1024 * 1024


class QueuedJobs:
    """Runs the queued jobs that reach this member, through `runner` (its own admission), with
    the `on_queued` handler or else the request handler; answers repeats from the window."""

    def __init__(
        self,
        make_runner: Callable[
            [
                Callable[[Token, bytes], None],
                Callable[[Token, BaseException], None],
                Callable[[Token, str], None],
            ],
            HandlerRunner,
        ],
        reply: Callable[[Token, bytes], None],
        reply_error: Callable[[Token, BaseException], None],
        turn_away: Callable[[Token, str], None],
        request_runner: HandlerRunner,
        stats: Counter[str],
    ) -> None:
        self._reply = reply
        self._reply_error = reply_error
        self._turn_away = turn_away
        self._requests = request_runner
        self.runner = make_runner(self._replied, self._failed, self._turned_away)
        self.own_handler = False  # `on_queued` set one; else the request handler runs jobs
        self.stats = stats
        self._answered: OrderedDict[bytes, bytes] = OrderedDict()
        self._answered_bytes = 0
        self._running: dict[bytes, list[Token]] = {}  # job id -> repeats waiting for its end
        self._jobs: dict[tuple[bytes, int], bytes] = {}  # running request -> its job id

    def handle(
        self, handler: RequestHandler, *, blocking: bool, pool: ThreadPoolExecutor | None
    ) -> None:
        """`on_queued`: jobs run `handler` instead of the request handler (in `pool` if it
        blocks)."""
        runner = self.runner
        runner.handler = handler
        runner.blocking = blocking
        runner.pool = pool
        self.own_handler = True

    def run(self, event: RequestArrived, traced: bool = False) -> None:
        payload = event.payload
        if len(payload) < MESSAGE_ID_SIZE:
            self.stats["jobs_malformed"] += 1
            self._reply_error(event.token, ProtocolError("malformed", "a job without its id"))
            return
        job_id = payload[:MESSAGE_ID_SIZE]
        answer = self._answered.get(job_id)
        if answer is not None:
            self.stats["jobs_absorbed"] += 1
            self._reply(event.token, answer)
            return
        repeats = self._running.get(job_id)
        if repeats is not None:
            self.stats["jobs_absorbed"] += 1
            repeats.append(event.token)
            return
        runner = self.runner
        if not self.own_handler:  # the request handler, as it is now
            requests = self._requests
            runner.handler, runner.blocking, runner.pool = (
                requests.handler,
                requests.blocking,
                requests.pool,
            )
        self._running[job_id] = []
        self._jobs[event.token[:2]] = job_id
        self.stats["jobs_run"] += 1
        job = payload[MESSAGE_ID_SIZE:]
        runner.run(
            RequestArrived(
                event.token, event.cluster, job, event.kind, event.deadline, 0, event.trace
            ),
            traced,
        )

    def _ended(self, token: Token) -> tuple[bytes | None, list[Token]]:
        job_id = self._jobs.pop(token[:2], None)
        if job_id is None:
            return None, []
        return job_id, self._running.pop(job_id, [])

    def _replied(self, token: Token, answer: bytes) -> None:
        job_id, repeats = self._ended(token)
        if job_id is not None and len(answer) <= WINDOW_BYTES // 4:
            self._answered[job_id] = answer
            self._answered_bytes += len(answer)
            while len(self._answered) > WINDOW_JOBS or self._answered_bytes > WINDOW_BYTES:
                _old, dropped = self._answered.popitem(last=False)
                self._answered_bytes -= len(dropped)
        for each in (token, *repeats):
            self._reply(each, answer)

    def _failed(self, token: Token, exc: BaseException) -> None:
        _job_id, repeats = self._ended(token)  # not kept: the memory hands a failed job out again
        for each in (token, *repeats):
            self._reply_error(each, exc)

    def _turned_away(self, token: Token, reason: str) -> None:
        _job_id, repeats = self._ended(token)
        for each in (token, *repeats):
            self._turn_away(each, reason)

    def cancel(self, event: RequestCancelled) -> None:
        """The dispatcher gave up on a job: as for a request (see HandlerRunner.cancel)."""
        self.runner.cancel(event)

    async def close(self) -> None:
        self.runner.pool = None  # the node's pool: the request runner shuts it down
        await self.runner.close()
