"""Rotating the checkpoint-signing key: a hand-over note, signed by the old key, names the new one.

A log's checkpoints are signed under its origin by one key at a time. When the operator replaces
that key (``[audit] signing_key`` new, ``previous_signing_key`` old), the broker signs, with both
keys, a note whose body is::

    broker-log-key-handover/v1
    <origin>
    <old verifier key>
    <new verifier key>
    <tree size when the new key took over>

records it in the log (a ``log_key_rotation`` record naming both keys), keeps it beside the log
(``<log>.key-handovers``) and serves it with the log's key (``GET /v1/log/key``). A monitor that
pinned the old key follows the log onto the new key only through such a note, signed by the key
it trusts (``follow_handovers``): the first line cannot start a checkpoint (its second line is
never a tree size), so a hand-over is never mistaken for one, nor the reverse.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from broker.crypto.checkpoint import NoteError, NoteVerifier

HANDOVER_V1 = "broker-log-key-handover/v1"


@dataclass(frozen=True)
class Handover:
    origin: str
    old_key: str
    new_key: str
    size: int

    def body(self) -> str:
        lines = (HANDOVER_V1, self.origin, self.old_key, self.new_key, str(self.size))
        return "".join(line + "\n" for line in lines)


def parse_handover(body: str) -> Handover:
    """A hand-over body (already opened by a verifier).

    Raises:
        NoteError: not a hand-over, or its keys are not note verifier keys of its origin.
    """
    lines = body.split("\n")
    if len(lines) != 6 or lines[0] != HANDOVER_V1 or lines[5] != "":
        raise NoteError("not a log key hand-over")
    origin, old, new, size = lines[1:5]
    if not size.isdigit():
        raise NoteError("the hand-over's tree size is not a number")
    for text in (old, new):
        if NoteVerifier.parse(text).name != origin:
            raise NoteError("a hand-over names keys of its own origin only")
    if old == new:
        raise NoteError("a hand-over names two different keys")
    return Handover(origin, old, new, int(size))


def follow_handovers(pinned: str, notes: Iterable[str]) -> list[Handover]:
    """The chain of hand-overs from ``pinned``: each signed by the key the previous one named
    (the first by ``pinned``). Notes that do not verify or do not continue the chain are
    ignored; a chain never returns to a key it left.

    Raises:
        NoteError: ``pinned`` is not a note verifier key.
    """
    candidates = list(notes)
    chain: list[Handover] = []
    current, seen = pinned.strip(), {pinned.strip()}
    while True:
        verifier = NoteVerifier.parse(current)
        step = None
        for note in candidates:
            try:
                handover = parse_handover(verifier.open(note))
            except NoteError:
                continue
            if handover.old_key == current and handover.new_key not in seen:
                step = handover
                break
        if step is None:
            return chain
        chain.append(step)
        current = step.new_key
        seen.add(current)
