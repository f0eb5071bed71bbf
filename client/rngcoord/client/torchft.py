"""torchft's replica groups on rngcoord streams: a healed replica draws what it would have.

torchft (``torchft.Manager``) changes a job's membership at every step without restarts:
replica groups join a quorum through a Lighthouse, a replica that dies is dropped while the
others train on, and a replica that comes back *heals*: a live peer sends it the state
registered with ``Manager.register_state_dict_fn``, and it rejoins at the current step.
torchft does nothing about random numbers. :func:`attach` adds the tracker's part::

    tracker = install(mesh, target, job, replica=os.environ["REPLICA_GROUP_ID"])
    manager = Manager(pg=ProcessGroupGloo(), ...)
    attach(manager, tracker)          # once, before the first random op
    optimizer = OptimizerWrapper(manager, optimizer)

- **A heal moves the stream with the model.** The peer sends its tracker state with its
  model; the healing replica continues *its own* groups (``/replica:<name>``, seeds of its
  own) at the peer's position: both ran the same ops up to this step, so that is where its
  streams would stand had it never left. Its masks from the heal on are bit for bit those of
  a run without the failure. Each restore is a Restore of the replica's group, audited.
- **Either quorum.** With ``use_async_quorum=False`` the peer's state arrives in
  ``start_quorum``, before the step draws. With the asynchronous quorum (torchft's default)
  it arrives in ``should_commit``, after the healing step drew from where the new process
  stood, and the peer sends it while its own step runs: the peer sends where its step began,
  and the healing replica replays the ops of its step (the same ops: the same model at the
  same step) onto that position. Either way, from the step after the heal on, the healed
  replica draws what it would have. (Under the asynchronous quorum the healing step itself
  trains on nothing: torchft zeroes that replica's gradients for it.)
- **A peer that ran other ops is refused.** Each replica keeps where its streams stood at its
  last step boundaries (the fingerprint chain of every op drawn, which names each op and its
  shape, not its seed), and sends them with its state. A replica that heals with streams
  already drawn checks that the peer's chain at its own step equals its own, and refuses the
  state otherwise: a replica that ran other code would draw other masks from the restored
  position, silently. A new process has drawn nothing to check.
- **Each quorum is audited.** Rank 0 of each replica records every torchft quorum the replica
  takes part in (its id, the step, how many replicas take part, the peer it healed from) as
  an audit record of kind ``quorum`` in its first group: ``rngcoord audit --kind quorum``
  shows the replica timeline beside each heal's Restores.
- **A step that does not commit is redrawn.** When ``should_commit()`` is false the step is
  redone; the tracker rewinds every stream the step moved to where the step began (a Restore
  each, voted by the replica's ranks, which all see the same verdict), so the redone step
  draws the same masks again and a failed commit never moves a stream.

This module never imports torchft: it calls the Manager's public methods only, and
``import rngcoord.client`` imports neither it nor torchft.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from rngcoord.client._coordinated import OffsetBasedRNGTracker, scoped_name
from rngcoord.client._errors import InvalidRequest
from rngcoord.client._groups import replica_name
from rngcoord.client._leases import INITIAL_DIGEST
from rngcoord.v1.rules import REPLICA_GROUP_PATTERN
from rngcoord.v1.seeds import group_seed

__all__ = ["HISTORY_STEPS", "STATE_KEY", "Attachment", "Quorum", "attach"]

STATE_KEY = "rngcoord"
"""The key under which :func:`attach` registers the tracker with the Manager."""

HISTORY_STEPS = 64
"""How many step boundaries a replica keeps, and sends, for a healing peer's check: a replica
that heals after falling further behind than this is not checked."""


@dataclass(frozen=True)
class Quorum:
    """A torchft quorum that a replica took part in, as :class:`Attachment` records it.

    Args:
        quorum_id: the Lighthouse's quorum id (the same on every replica of the quorum).
        step: the step it formed at (the peer's, for a replica that healed in it).
        participants: how many replicas take part.
        healed_from: the peer replica whose state this replica loaded in it; "" for none.
    """

    quorum_id: int
    step: int
    participants: int
    healed_from: str = ""


class Manager(Protocol):
    """What :func:`attach` uses of a ``torchft.Manager``."""

    def register_state_dict_fn(self, key: str, load_state_dict: Any, state_dict: Any) -> None: ...

    def start_quorum(self, *args: Any, **kwargs: Any) -> None: ...

    def should_commit(self, *args: Any, **kwargs: Any) -> bool: ...

    def current_step(self) -> int: ...

    def num_participants(self) -> int: ...


_attached: weakref.WeakKeyDictionary[Any, Attachment] = weakref.WeakKeyDictionary()
_attached_lock = threading.Lock()


class Attachment:
    """A tracker attached to a torchft Manager (what :func:`attach` returns).

    Args:
        manager: the replica's ``torchft.Manager``.
        tracker: this rank's tracker, installed with ``replica=``.
    """

    def __init__(self, manager: Manager, tracker: OffsetBasedRNGTracker) -> None:
        self.manager = manager
        self.tracker = tracker
        self.heals = 0
        """Peer states loaded (heals of this replica)."""
        self.rewinds = 0
        """Steps whose commit failed and whose streams were rewound."""
        self.asynchronous = bool(getattr(manager, "_use_async_quorum", False))
        """Whether the Manager runs its quorum asynchronously (torchft's
        ``use_async_quorum``, read from the Manager: it has no public accessor)."""
        self.quorums: list[Quorum] = []
        """The quorums this replica took part in, in order (each one it saw change)."""
        self._healed_from = ""
        self._unsent: list[Quorum] = []
        self._mark: dict[str, Any] | None = None
        # Where the streams stood at this replica's latest step boundary, and at the ones
        # before it: {step: {tag: digest}}, the newest last.
        self._boundary: tuple[int, dict[str, bytes]] | None = None
        self._history: OrderedDict[int, dict[str, bytes]] = OrderedDict()

    # -- what the Manager calls ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a peer sends a healing replica: this replica's name, its step, and the
        tracker's state where the step began (under the asynchronous quorum torchft calls
        this from its quorum thread while the step's ops draw)."""
        mark = self._mark if self.asynchronous else None
        step = self.manager.current_step()
        state = mark if mark is not None else self.tracker.state_dict()
        return {
            "replica": self.tracker.replica,
            "step": step,
            "tracker": state,
            "history": {**self._history, step: _digests(state)},
        }

    def load_state_dict(self, sent: Mapping[str, Any]) -> None:
        """Continue this replica's own groups where the peer's groups stand.

        Raises:
            InvalidRequest: as :meth:`translate`; or the peer's streams, at this replica's
                latest step boundary, had drawn other ops than this replica's.
        """
        start = self.translate(sent)
        self._check_same_ops(sent)
        if self.asynchronous and self._mark is not None:
            # In should_commit, after this step drew: the peer's position is where its step
            # began, and this step ran the same ops, so they are replayed onto it. A commit
            # that fails redoes the step from the peer's position.
            self.tracker.load_state_dict(self._replayed(start))
            self._mark = start
        else:
            self.tracker.load_state_dict(start)
        self.heals += 1
        self._healed_from = str(sent["replica"])

    def _replayed(self, start: dict[str, Any]) -> dict[str, Any]:
        """``start`` moved on by the ops this process drew since :meth:`mark`, as each op
        moves a stream: its cursor by the op's size, its fingerprint chain by the op's key."""
        streams = {}
        for tag, entry in start["streams"].items():
            lease = self.tracker.leases.get(tag)
            cursor, digest = entry["offset"], entry["digest"]
            largest = entry.get("largest_op", 0)
            for size, key in lease.recorded_ops() if lease is not None else ():
                cursor += size
                digest = hashlib.sha256(digest + key).digest()
                largest = max(largest, size)
            streams[tag] = {**entry, "offset": cursor, "digest": digest, "largest_op": largest}
        return {**start, "streams": streams}

    def translate(self, sent: Mapping[str, Any]) -> dict[str, Any]:
        """The peer's tracker state as this replica's: each ``<group>/replica:<peer>`` stream
        becomes ``<group>/replica:<ours>`` at the same cursor and fingerprint chain, with its
        own seed; the peer's epochs, which say nothing about our groups, are dropped.

        Raises:
            InvalidRequest: the state is not an attached peer's, is another job's, or names a
                stream that is not a replica's, or whose seed is not its group's under the
                state's root seed.
        """
        peer, state = sent.get("replica"), sent.get("tracker")
        if not isinstance(peer, str) or not isinstance(state, Mapping):
            raise InvalidRequest(
                f"the state under key {STATE_KEY!r} is not an attached peer's "
                "(rngcoord.client.torchft.attach on every replica): nothing was restored"
            )
        job, ours = self.tracker.job, self.tracker.replica
        assert ours is not None  # attach() checked
        if state.get("job") != job:
            raise InvalidRequest(
                f"replica {peer!r} sent the state of job {state.get('job')!r}, and this "
                f"replica belongs to job {job!r}: every replica of a torchft job must "
                "install() with the same job name; nothing was restored"
            )
        root = state.get("job_seed")
        streams: dict[str, Any] = {}
        for tag, entry in dict(state.get("streams") or {}).items():
            if not isinstance(entry, Mapping):
                raise InvalidRequest(f"stream {tag!r} of replica {peer!r}'s state is malformed")
            mine = _counterpart(tag, peer, ours)
            seed = entry.get("seed")
            if isinstance(root, int) and seed != group_seed(root, tag):
                raise InvalidRequest(
                    f"replica {peer!r}'s stream {tag!r} has seed {seed!r}, not its group's "
                    f"seed under the state's root seed {root}: nothing was restored"
                )
            moved = {k: v for k, v in entry.items() if k != "epoch"}
            if isinstance(root, int):
                moved["seed"] = group_seed(root, mine)
            streams[mine] = moved
        return {**state, "streams": streams}

    def _check_same_ops(self, sent: Mapping[str, Any]) -> None:
        """Refuse a peer whose fingerprint chains, at this replica's latest step boundary,
        are not this replica's: it drew other ops (other code, another model), and this
        replica would draw other masks from its position than the peer did."""
        if self._boundary is None:
            return
        step, ours = self._boundary
        drawn = {tag: digest for tag, digest in ours.items() if digest != INITIAL_DIGEST}
        if not drawn:
            return  # nothing drawn yet: any position continues it
        peer = str(sent["replica"])
        history = sent.get("history")
        theirs = history.get(step) if isinstance(history, Mapping) else None
        if not isinstance(theirs, Mapping):
            return  # the peer keeps no boundary this old (HISTORY_STEPS): nothing to compare
        ours_name = self.tracker.replica or ""
        mapped = {_counterpart(tag, peer, ours_name): d for tag, d in theirs.items()}
        differ = sorted(
            tag
            for tag in drawn.keys() | mapped.keys()
            if mapped.get(tag, INITIAL_DIGEST) != ours.get(tag, INITIAL_DIGEST)
        )
        if differ:
            raise InvalidRequest(
                f"replica {peer!r} drew other ops than this replica up to step {step} "
                f"(the fingerprint chains of {', '.join(map(repr, differ))} differ): the "
                "replicas run different code, and this one would draw other masks from the "
                "peer's position. Run the same model and steps on every replica; nothing was "
                "restored"
            )

    def _note_boundary(self, state: Mapping[str, Any]) -> None:
        """Remember ``state`` as where this replica's current step begins."""
        step = self.manager.current_step()
        digests = _digests(state)
        self._boundary = (step, digests)
        self._history[step] = digests
        self._history.move_to_end(step)
        while len(self._history) > HISTORY_STEPS:
            self._history.popitem(last=False)

    def note_quorum(self, *, committed: bool) -> None:
        """After a step's commit verdict (its quorum is complete then, under either quorum):
        record the quorum when it is new, or when this replica healed in it, and send what
        is unsent once this rank has joined a group."""
        quorum_id = getattr(self.manager, "_quorum_id", None)  # no public accessor either
        last = self.quorums[-1].quorum_id if self.quorums else None
        participants = int(self.manager.num_participants())
        if (
            isinstance(quorum_id, int)
            and quorum_id >= 0
            and participants > 0  # 0: no quorum yet
            and (quorum_id != last or self._healed_from)
        ):
            quorum = Quorum(
                quorum_id=quorum_id,
                step=self.manager.current_step() - (1 if committed else 0),
                participants=participants,
                healed_from=self._healed_from,
            )
            self.quorums.append(quorum)
            self._unsent.append(quorum)
            self._healed_from = ""
        self._send_quorums()

    def _send_quorums(self) -> None:
        # One record per replica: its rank 0 sends, in the first group it joined (the
        # coordinator keeps one record per epoch and quorum id, so a resend is harmless).
        if self.tracker.rank != 0:
            self._unsent.clear()
            return
        joined = next(iter(self.tracker.leases.items()), None)
        if joined is None:
            return  # before the first random op: sent at a later step's verdict
        group, lease = joined
        while self._unsent:
            quorum = self._unsent[0]
            self.tracker.client.record_quorum(
                self.tracker.job,
                group,
                epoch=lease.epoch,
                quorum_id=quorum.quorum_id,
                step=quorum.step,
                participants=quorum.participants,
                healed_from=quorum.healed_from,
                rank=lease.rank,
                member_id=self.tracker.member_id,
            )
            self._unsent.pop(0)

    # -- the step ------------------------------------------------------------------------

    def mark(self) -> None:
        """Where this step begins: after the quorum, and any heal, of a synchronous
        ``start_quorum``; before an asynchronous one (whose heal comes later), from when the
        step's ops are recorded."""
        self._mark = self.tracker.state_dict()
        self._note_boundary(self._mark)
        if self.asynchronous:
            self.tracker.record_ops()

    def committed(self) -> None:
        """After a step committed: under the synchronous quorum the next step's heal comes
        before its mark, and is checked against where this step ended."""
        if not self.asynchronous:
            self._note_boundary(self.tracker.state_dict())

    def rewind(self) -> None:
        """Put every stream the uncommitted step moved back where the step began."""
        mark = self._mark
        if mark is None:
            return
        before = mark["streams"]
        back: dict[str, Any] = {}
        for tag, entry in self.tracker.state_dict()["streams"].items():
            start = before.get(tag)
            if start is None:
                # Joined during the step: it began at its origin, before any op.
                start = {**entry, "offset": entry["origin"], "digest": INITIAL_DIGEST}
            if start["offset"] != entry["offset"] or start["digest"] != entry["digest"]:
                back[tag] = {k: v for k, v in start.items() if k != "epoch"}
        if back:
            self.tracker.load_state_dict({**mark, "streams": back})
            self.rewinds += 1


def attach(manager: Manager, tracker: OffsetBasedRNGTracker) -> Attachment:
    """Make ``tracker``'s streams follow ``manager``'s steps and heals; call it once per
    process, before the first random op.

    Registers the tracker's state with ``manager.register_state_dict_fn("rngcoord", ...)``
    so that a healing replica receives its peer's stream position with the model, and wraps
    the manager's ``start_quorum`` (to note where each step begins) and ``should_commit``
    (to rewind the streams of a step that did not commit).

    Args:
        manager: this replica's ``torchft.Manager`` (either quorum).
        tracker: this rank's tracker from :func:`rngcoord.client.install`, with ``replica``
            set (or REPLICA_GROUP_ID in the environment).

    Raises:
        InvalidRequest: the tracker or the manager is attached already; the tracker has
            drawn random numbers already; or the tracker has no replica.
    """
    if tracker.replica is None:
        raise InvalidRequest(
            "attach() needs a tracker of a replica: install(..., replica=NAME), or set "
            "REPLICA_GROUP_ID as torchft's launchers do, so that each replica draws from "
            "groups of its own"
        )
    drawn = sorted(tag for tag, lease in tracker.leases.items() if lease.ops)
    if drawn:
        raise InvalidRequest(
            f"attach() must come before the first random op, and this tracker has drawn in "
            f"{', '.join(map(repr, drawn))} already: a heal could not tell where this "
            "process's streams stand. Call attach() right after install() and Manager()"
        )
    with _attached_lock:
        for key, what in ((tracker, "tracker"), (manager, "manager")):
            if key in _attached:
                raise InvalidRequest(f"this {what} is attached already: call attach() once")
        attachment = Attachment(manager, tracker)
        manager.register_state_dict_fn(STATE_KEY, attachment.load_state_dict, attachment.state_dict)
        _wrap(manager, attachment)
        _attached[tracker] = _attached[manager] = attachment
    return attachment


def _wrap(manager: Manager, attachment: Attachment) -> None:
    # The Manager has no hooks for a step's start or its commit verdict; torchft's own
    # OptimizerWrapper calls these two methods on the instance, so wrapping them there
    # sees every step, however the training loop drives the Manager.
    start_quorum, should_commit = manager.start_quorum, manager.should_commit

    def start(*args: Any, **kwargs: Any) -> None:
        if attachment.asynchronous:
            # The quorum thread may send this replica's state as soon as it starts.
            attachment.mark()
            start_quorum(*args, **kwargs)
        else:
            start_quorum(*args, **kwargs)  # may heal this replica
            attachment.mark()

    def commit(*args: Any, **kwargs: Any) -> bool:
        committed = should_commit(*args, **kwargs)
        if committed:
            attachment.committed()
        else:
            attachment.rewind()
        attachment.note_quorum(committed=committed)
        return committed

    manager.start_quorum = start  # type: ignore[method-assign]
    manager.should_commit = commit  # type: ignore[method-assign]


def _counterpart(tag: str, peer: str, ours: str) -> str:
    """Our group for the peer's group ``tag``."""
    m = REPLICA_GROUP_PATTERN.fullmatch(tag)
    if m is None or m["replica"] != peer:
        raise InvalidRequest(
            f"stream {tag!r} of replica {peer!r}'s state is not one of that replica's groups "
            f"(…/replica:{peer}): was the peer installed with replica={peer!r}? nothing was "
            "restored"
        )
    name = replica_name(m["base"], ours)
    return name if m["scope"] is None else scoped_name(name, int(m["scope"]))


def _digests(state: Mapping[str, Any]) -> dict[str, bytes]:
    """Each stream's fingerprint chain in a tracker state."""
    return {tag: bytes(entry["digest"]) for tag, entry in dict(state.get("streams") or {}).items()}
