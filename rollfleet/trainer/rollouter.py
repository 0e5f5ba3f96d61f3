"""The rollouter of the async modes: keeps GRPO groups generating into the group buffer.

It runs in the trainer's event loop; the trajectories themselves run in the agent-loop workers,
so a learner step (run in a thread) never stops generation. It keeps at most
``max_inflight_groups`` groups in flight and starts a new one only when the buffer allows it
(queue room, staleness bound). With ``partial_rollout`` off, the client resumes an aborted
trajectory only on the weights that sampled it, and a group with one still aborted (or spanning
versions) is regenerated from scratch: nothing truncated or mixed by a weight update is trained on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional

from rollfleet.trainer.staleness import Group, GroupBuffer
from rollfleet.trainer.tasks import TaskStream
from rollfleet.utils.aio import gather_or_cancel

logger = logging.getLogger(__name__)


def was_aborted(output: Any) -> bool:
    extra = output.extra_fields
    return extra.get("stop_reason") == "aborted" or extra.get("termination") == "aborted"


def spans_versions(output: Any) -> bool:
    """Whether ``output`` was sampled by more than one weight version: a multi-turn trajectory
    whose turns fell either side of a sync, none of them aborted (its first turn on v, its next
    on v+1), or one turn continued across a keep-mode commit."""
    lo, hi = output.extra_fields.get("min_global_steps"), output.extra_fields.get("max_global_steps")
    return lo is not None and hi is not None and lo != hi


class Rollouter:
    def __init__(
        self,
        agent_manager: Any,
        stream: TaskStream,
        buffer: GroupBuffer,
        *,
        n: int,
        max_inflight_groups: int,
        partial_rollout: bool,
        version: Callable[[], int],
        reissue: Optional[list[int]] = None,
    ) -> None:
        self.agent_manager = agent_manager
        self.stream = stream
        self.buffer = buffer
        self.n = n
        self.max_inflight_groups = max_inflight_groups
        self.partial_rollout = partial_rollout
        self._version = version
        self._reissue = list(reissue or [])
        self._task: Optional[asyncio.Task[None]] = None
        self._groups: set[asyncio.Task[None]] = set()
        #: task_index -> version the group started at, for every group neither delivered nor
        #: failed (a stopped rollouter keeps its cancelled groups here, for the final checkpoint).
        self.inflight: dict[int, int] = {}
        self.regenerated = 0
        self.errors = 0
        #: The run stops when this many groups fail in a row, or one prompt fails this many times:
        #: a prompt that always fails (too long, a tool that always breaks), its tries interleaved
        #: with other groups' successes, was re-issued for the whole run and never trained.
        self.max_consecutive_errors = 3
        self._consecutive_errors = 0
        self._failures: dict[int, int] = {}  # task_index -> failed tries (until one is delivered)
        self.generated_tokens = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="rollfleet-rollouter")

    def inflight_task_indices(self) -> list[int]:
        """Prompts taken from the stream but not delivered (generating, stopped, or waiting to be
        re-issued): what a checkpoint must re-issue first after a resume."""
        return sorted(set(self.inflight) | set(self._reissue))

    async def _run(self) -> None:
        """Start groups for good; should that fail (the task stream raised), the trainer hears so
        at its next ``take`` instead of waiting forever for groups nobody starts."""
        try:
            await self._start_groups()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.error("the rollouter stopped starting groups: %r", exc)
            await self.buffer.fail(exc)

    async def _start_groups(self) -> None:
        sem = asyncio.Semaphore(self.max_inflight_groups)

        def group_done(task: asyncio.Task[None]) -> None:
            self._groups.discard(task)
            sem.release()

        while True:
            await sem.acquire()
            ticket: Optional[int] = None
            try:
                ticket = await self.buffer.wait_to_start()
                sample = self.stream.sample_at(self._reissue[0]) if self._reissue else self.stream.next()
            except BaseException:
                sem.release()
                if ticket is not None:
                    await asyncio.shield(self.buffer.abandon(ticket))
                raise
            if self._reissue:
                self._reissue.pop(0)  # taken only once its sample is: a failed one stays to be re-issued
            # Counted before the task runs: a task cancelled before its first step runs no code.
            self.inflight[int(sample.get("task_index", -1))] = self._version()
            task = asyncio.get_running_loop().create_task(self._group(sample, ticket))
            self._groups.add(task)
            task.add_done_callback(group_done)

    async def _group(self, sample: dict[str, Any], ticket: int = -1) -> None:
        index = int(sample.get("task_index", -1))
        started = self.inflight.setdefault(index, self._version())
        delivered = stopped = False
        try:
            resumes = 0
            while True:
                samples = self.agent_manager.expand([sample], self.n)
                outputs = await gather_or_cancel(self.agent_manager.generate_sequences_single(s) for s in samples)
                # without partial rollout a response is one policy's: interrupted, or across a sync
                if not self.partial_rollout and any(was_aborted(o) or spans_versions(o) for o in outputs):
                    self.regenerated += 1
                    started = self._version()
                    continue
                break
            for o in outputs:
                resumes += int(o.metrics.num_resumes)
                self.generated_tokens += int(sum(o.response_mask))
            versions_lo = [o.extra_fields.get("min_global_steps") for o in outputs]
            versions_hi = [o.extra_fields.get("max_global_steps") for o in outputs]
            lo = min((v for v in versions_lo if v is not None), default=started)
            hi = max((v for v in versions_hi if v is not None), default=started)
            group = Group(
                uid=samples[0]["uid"],
                outputs=outputs,
                started_version=started,
                min_version=lo,
                max_version=hi,
                task_index=index,
                resumes=resumes,
                ticket=ticket,
            )
            await self.buffer.put(group)
            delivered = True
            self._consecutive_errors = 0
            self._failures.pop(index, None)
        except asyncio.CancelledError:
            stopped = True  # the run ends or fails: the prompt stays in flight for the final checkpoint
            raise
        except Exception as exc:
            self.errors += 1
            self._consecutive_errors += 1
            tries = self._failures[index] = self._failures.get(index, 0) + 1
            self._reissue.append(index)  # a checkpoint keeps it, even when the run stops now
            if self._consecutive_errors >= self.max_consecutive_errors:
                logger.error("rollout failed %d times in a row; stopping: %r", self._consecutive_errors, exc)
                await self.buffer.fail(exc)
            elif tries >= self.max_consecutive_errors:
                logger.error("the rollout of prompt %s failed %d times; stopping: %r", index, tries, exc)
                await self.buffer.fail(RuntimeError(f"the rollout of prompt {index} failed {tries} times: {exc!r}"))
            else:
                logger.warning("rollout of prompt %s failed (%r); it will be re-issued", index, exc)
        finally:
            if not stopped:
                self.inflight.pop(index, None)
            if not delivered:
                await asyncio.shield(self.buffer.abandon(ticket))

    async def stop(self) -> None:
        for task in [self._task, *self._groups]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._task, *self._groups] if t is not None), return_exceptions=True)
        self._task = None
        self._groups.clear()


__all__ = ["Rollouter", "was_aborted"]
