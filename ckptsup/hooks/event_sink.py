"""Where the hooks' events go: up the channel as `event` frames when an agent listens, else into
<run_dir>/events.jsonl (rank 0 only: one writer per file) when CKPTSUP_RUN_DIR is set, else only
to the log."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..env import RankEnv
from ..events import Event, EventWriter, make_event
from .. import messages
from .agent_socket import RankChannel

log = logging.getLogger("ckptsup.hooks")


class Reporter:
    def __init__(self, *, env: RankEnv, rank: int, channel: RankChannel) -> None:
        self.env = env
        self.rank = rank
        self.channel = channel
        self._writer: EventWriter | None = None
        if not channel.connected and env.run_dir and rank == 0:
            self._writer = EventWriter(run_dir=Path(env.run_dir), job_id=env.job_id, attempt=env.attempt,
                                       epoch=env.epoch)

    def emit(self, name: Event, *, all_ranks: bool = False, **fields: Any) -> None:
        """Rank 0's events reach the restart log; `all_ranks` also sends other ranks' copies up
        the channel (the supervisor de-duplicates by rank). `name` must be an Event member (or
        its value): every rank checks, whichever path the event then takes (Event.coerce)."""
        name = Event.coerce(name)
        if self.rank != 0 and not all_ranks:
            return
        fields.setdefault("rank", self.rank)
        if self.channel.connected:
            record = make_event(name, job_id=self.env.job_id, attempt=self.env.attempt, epoch=self.env.epoch, **fields)
            self.channel.send(messages.EventRecord(record=record))
        elif self._writer is not None:
            self._writer.emit(name, **fields)
        log.info("ckptsup event %s %s", name.value, fields)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
