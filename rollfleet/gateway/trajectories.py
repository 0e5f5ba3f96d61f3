"""What each session generated, token for token: the record a trainer builds its batch from.

An agent that talks to the gateway over HTTP sends messages and gets text back, but an RL trainer
needs the exact token ids the engine was prompted with and sampled, which of them the model wrote
(the loss mask), their logprobs and the weights that sampled each one. The gateway is the only
place that sees both sides, so it keeps them per session:

* a **turn** is one chat request of the session: the prompt ids sent to the fleet and each
  choice's sampled ids, logprobs and per-token weight versions, and the assistant message the
  caller was given for it;
* a **branch** is a run of turns where each one's prompt extends the last one's prompt plus the
  choice the caller went on with (:mod:`rollfleet.gateway.continuation` builds that prompt from
  the ids, never from re-rendered text). A caller that edits its history starts a new branch, and
  the branch says why.

Memory is bounded: ``gateway.max_sessions`` sessions (least recently used evicted first),
``gateway.session_ttl_s`` of idleness, and ``gateway.max_session_branches`` branches a session
(the oldest dropped first: a caller that sends every conversation under one id, OpenAI's ``user``
field, would otherwise grow one session for ever, touched too often to expire); every eviction is
counted. A branch itself is bounded by the context, each turn extending the last, and holds it
once: a turn keeps only the ids it added (:class:`Turn`). Ended sessions leave a tombstone so that
a late reward or trajectory request is told "ended", not "unknown"; a closed one
(:meth:`TrajectoryStore.close`) also refuses new chat requests.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from rollfleet.gateway.errors import GatewayError

logger = logging.getLogger(__name__)


@dataclass
class Sampled:
    """One choice of one turn: what the model wrote, and what the caller was shown for it."""

    token_ids: list[int]
    logprobs: list[Optional[float]]  # None: the engine gave none (never made up: a trainer would use it)
    versions: list[Optional[int]]
    finish_reason: str
    message: dict[str, Any]


class Turn:
    """One chat request of a session: its prompt ids and each choice.

    A turn that goes on from an earlier one (its first ``reused`` ids are that turn's prompt and
    the choice carried) holds, once recorded after it (:meth:`follow`), only the ids after them
    and reads the rest from that turn: a turn holding its whole prompt made a session's memory
    grow with the square of its turns (400 turns of 10 new tokens each: 6.9 MB for a 4,400-token
    trajectory, against 0.5 MB now; a test).
    """

    __slots__ = ("choices", "reused", "chosen", "prompt_len", "_own", "_base", "_base_choice")

    def __init__(self, prompt_ids: list[int], choices: list[Sampled], reused: int = 0, chosen: int = 0) -> None:
        self.choices = choices
        #: Prompt ids carried over from the branch's previous turn (prompt + the chosen choice).
        self.reused = reused
        #: The choice the next turn went on with (0 until one does).
        self.chosen = chosen
        self.prompt_len = len(prompt_ids)
        self._own = prompt_ids  # the ids after the turn it follows (all of them, following none)
        self._base: Optional[Turn] = None
        self._base_choice = 0

    @property
    def prompt_ids(self) -> list[int]:
        """The whole prompt, built from the turns it follows (a new list each time)."""
        parts = []
        turn = self
        while turn._base is not None:
            parts.append(turn._own)
            parts.append(turn._base.choices[turn._base_choice].token_ids)
            turn = turn._base
        parts.append(turn._own)
        ids: list[int] = []
        for part in reversed(parts):
            ids.extend(part)
        return ids

    def follow(self, base: "Turn", choice: int) -> None:
        """Hold only the ids after ``base``'s prompt and its ``choice``, where those are the ids
        this turn reused; anything else (a turn planned on another prompt) keeps its own."""
        carried = base.prompt_len + len(base.choices[choice].token_ids)
        if self._base is None and self.reused == carried <= len(self._own):
            self._own = self._own[carried:]
            self._base, self._base_choice = base, choice

    def choosing(self, chosen: int) -> "Turn":
        """A copy marking ``chosen`` (a fork's; its prompt is shared, never changed)."""
        twin = copy.copy(self)
        twin.chosen = chosen
        return twin


@dataclass
class Branch:
    why: str
    turns: list[Turn] = field(default_factory=list)

    def view(self) -> dict[str, Any]:
        """The branch as a trainer reads it: the full token sequence with its mask, logprobs and
        weight versions (zeros and ``None`` where the model did not sample; a sampled token's
        logprob is ``None`` where the engine gave none), and each turn's shape."""
        last = self.turns[-1]
        ids = last.prompt_ids
        ids += last.choices[last.chosen].token_ids
        mask = [0] * len(ids)
        logprobs: list[Optional[float]] = [0.0] * len(ids)
        versions: list[Optional[int]] = [None] * len(ids)
        turns = []
        for turn in self.turns:
            choice = turn.choices[turn.chosen]
            start, end = turn.prompt_len, turn.prompt_len + len(choice.token_ids)
            mask[start:end] = [1] * (end - start)
            logprobs[start:end] = choice.logprobs
            versions[start:end] = choice.versions
            turns.append(
                {
                    "prompt_tokens": start,
                    "reused_prompt_tokens": turn.reused,
                    "response_tokens": end - start,
                    "finish_reason": choice.finish_reason,
                    "choices": len(turn.choices),
                    "chosen": turn.chosen,
                }
            )
        return {
            "why": self.why,
            "token_ids": ids,
            "mask": mask,
            "logprobs": logprobs,
            "weight_versions": versions,
            "turns": turns,
        }


@dataclass
class Session:
    session_id: str
    created: float
    touched: float
    #: The last turn's request: its messages, tools and chat template kwargs (what the next turn
    #: must extend, rendered alike).
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: Optional[list[dict[str, Any]]] = None
    template_kwargs: Optional[dict[str, Any]] = None
    branches: list[Branch] = field(default_factory=list)
    reward: Optional[float] = None
    #: Turns recorded: the chat requests answered (a fork copies turns into its branch, and old
    #: branches are dropped, so the branches' turns do not count them).
    requests: int = 0

    @property
    def last_turn(self) -> Optional[Turn]:
        return self.branches[-1].turns[-1] if self.branches else None

    def snapshot(self) -> "SessionSnapshot":
        """What the next turn is planned on, read at once (the record replaces these, never
        mutates them), for planning off the event loop while other turns are recorded."""
        return SessionSnapshot(self.messages, self.tools, self.last_turn, self.template_kwargs)


@dataclass(frozen=True)
class SessionSnapshot:
    messages: list[dict[str, Any]]
    tools: Optional[list[dict[str, Any]]]
    last_turn: Optional[Turn]
    template_kwargs: Optional[dict[str, Any]] = None


def _fork(session: Session, base: Turn, chosen: int) -> Branch:
    """A branch of the turns up to ``base`` (its copy marks ``chosen``; the branch it came from
    keeps its own choice), for a turn that extended ``base`` after another turn already had."""
    for branch in session.branches:
        for i, turn in enumerate(branch.turns):
            if turn is base:
                why = f"concurrent turn: forked after turn {i} (another turn of the session extended it first)"
                return Branch(why, [*branch.turns[:i], base.choosing(chosen)])
    return Branch("concurrent turn: the turn it extended is no longer recorded")


class TrajectoryStore:
    """Sessions by id, least recently used first; evicts past ``max_sessions`` and ``ttl_s``."""

    def __init__(
        self, max_sessions: int, ttl_s: float, clock: Callable[[], float] = time.monotonic, max_branches: int = 64
    ) -> None:
        self.max_sessions = max_sessions
        self.max_branches = max_branches
        self.ttl_s = ttl_s
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._ended: OrderedDict[str, str] = OrderedDict()  # id -> why (tombstones, same bound)
        self._closed: OrderedDict[str, None] = OrderedDict()  # ids never to be opened again (same bound)
        self.evicted = {"capacity": 0, "ttl": 0, "branches": 0}
        self.late_turns = 0  #: turns that finished after their session ended (not recorded)

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Optional[Session]:
        self._expire()
        return self._sessions.get(session_id)

    def record(
        self,
        session_id: str,
        messages: list[dict[str, Any]],
        tools: Optional[list[dict[str, Any]]],
        turn: Turn,
        *,
        new_branch: Optional[str],
        chosen: Optional[int] = None,
        base: Optional[Turn] = None,
        template_kwargs: Optional[dict[str, Any]] = None,
        planned_on: Optional[Session] = None,
    ) -> bool:
        """Add ``turn``: to a new branch (``new_branch`` says why) or after ``base``, the turn it
        was planned on, marking which choice of ``base`` it went on with. When another turn of
        the session was recorded after ``base`` meanwhile (two requests extending one turn at
        once), ``turn`` forks a branch at ``base`` instead of following a turn it never saw. A turn
        planned on a session that has ended (or was evicted) since is not recorded: the session
        stays ended, and a new session under its id (``planned_on``: the session the turn was
        planned on) is not given a turn of the old one. Returns whether the turn was recorded."""
        now = self._clock()
        session = self.get(session_id)
        closed = session_id in self._closed
        if closed or (session is None and base is not None) or (planned_on is not None and session is not planned_on):
            logger.info("session %r ended while a turn ran: the turn is not recorded", session_id)
            self.late_turns += 1
            return False
        if session is None:
            session = Session(session_id, created=now, touched=now)
            self._sessions[session_id] = session
            self._ended.pop(session_id, None)  # an id used again is a new session
        if new_branch is not None or not session.branches:
            session.branches.append(Branch(new_branch or "first turn"))
        elif base is not None and session.last_turn is not base:
            session.branches.append(_fork(session, base, chosen or 0))
        else:
            session.branches[-1].turns[-1].chosen = chosen or 0
        if new_branch is None and base is not None:
            turn.follow(base, chosen or 0)
        session.branches[-1].turns.append(turn)
        session.requests += 1
        if len(session.branches) > self.max_branches:  # the oldest go; the last is what is trained
            del session.branches[: len(session.branches) - self.max_branches]
            self.evicted["branches"] += 1
        session.messages, session.tools, session.touched = messages, tools, now
        session.template_kwargs = template_kwargs
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.max_sessions:
            evicted, _ = self._sessions.popitem(last=False)
            self._tombstone(evicted, "evicted: over gateway.max_sessions")
            self.evicted["capacity"] += 1
        return True

    def trajectory(self, session_id: str) -> dict[str, Any]:
        session = self._known(session_id)
        return {
            "session_id": session_id,
            "reward": session.reward,
            "num_turns": sum(len(b.turns) for b in session.branches),
            "num_requests": session.requests,
            "branches": [b.view() for b in session.branches],
        }

    def set_reward(self, session_id: str, reward: float) -> None:
        self._known(session_id).reward = reward

    def end(self, session_id: str) -> bool:
        """Forget the session (its record is gone); False when there was none."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._tombstone(session_id, "ended (DELETE)")
        return True

    def close(self, session_id: str, why: str) -> None:
        """End the session for good: a chat request under its id is refused before it generates
        (:meth:`check_open`), and a turn still running is not recorded. For ids nobody may use
        again (``http_agent``'s, one per run): an agent that outlived its run (a synchronous one
        on a thread cannot be stopped) went on generating on the fleet and opened its session
        again, a record nobody would read."""
        self._sessions.pop(session_id, None)
        self._tombstone(session_id, why)
        self._closed[session_id] = None
        self._closed.move_to_end(session_id)
        while len(self._closed) > self.max_sessions:
            self._closed.popitem(last=False)

    def check_open(self, session_id: str, param: str = "session_id") -> None:
        """Raise 409 ``session_ended`` if the session was closed (:meth:`close`)."""
        if session_id in self._closed:
            why = self._ended.get(session_id, "closed")
            raise GatewayError(409, f"session {session_id!r} is closed: {why}", param=param, code="session_ended")

    def _known(self, session_id: str) -> Session:
        session = self.get(session_id)
        if session is not None:
            session.touched = self._clock()
            self._sessions.move_to_end(session_id)
            return session
        why = self._ended.get(session_id)
        if why is not None:
            raise GatewayError(
                409,
                f"session {session_id!r} has no trajectory any more: {why}",
                param="session_id",
                code="session_ended",
            )
        raise GatewayError(
            404,
            f"no session {session_id!r} on this gateway (a session starts with a chat request carrying it)",
            "not_found_error",
            "session_id",
            "session_not_found",
        )

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl_s
        while self._sessions:
            session_id, session = next(iter(self._sessions.items()))
            if session.touched > deadline:
                break
            self._sessions.popitem(last=False)
            self._tombstone(session_id, f"expired: idle over gateway.session_ttl_s={self.ttl_s:g}s")
            self.evicted["ttl"] += 1

    def _tombstone(self, session_id: str, why: str) -> None:
        self._ended[session_id] = why
        self._ended.move_to_end(session_id)
        while len(self._ended) > self.max_sessions:
            self._ended.popitem(last=False)


__all__ = ["Sampled", "Turn", "Branch", "Session", "SessionSnapshot", "TrajectoryStore"]
