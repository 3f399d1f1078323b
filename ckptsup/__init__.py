"""ckptsup: the public training API.

    import ckptsup
    run = ckptsup.attach(model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader)
    step = run.resume()
    ...

or, for a script that keeps its own checkpoints, one call per step (docs/heartbeat.md):

    ckptsup.heartbeat(step, loss)

and around an evaluation, so that its quiet time is not taken for a hang (docs/training.md §Phases):

    with ckptsup.phase("eval"):
        ...
        ckptsup.phase_heartbeat()       # optional, e.g. once per eval batch

`import ckptsup` stays cheap: torch is imported on the first `attach` (the supervisor imports
this package too and must start in well under a second); `heartbeat` never imports it.
"""

from __future__ import annotations

from typing import Any

from ._version import __version__

__all__ = ["attach", "heartbeat", "init_process_group", "phase", "phase_heartbeat", "__version__"]


def attach(**kwargs: Any):
    """Attach ckptsup to a training loop; see ckptsup.hooks.session.attach."""
    from .hooks.session import attach as _attach

    return _attach(**kwargs)


def init_process_group(**kwargs: Any):
    """torch.distributed.init_process_group with the supervisor's collective timeout."""
    from .hooks.process_group import init_process_group as _init

    return _init(**kwargs)


def phase(name: str = "eval"):
    """`with ckptsup.phase("eval"):` (or a decorator): the rank is evaluating; see ckptsup.hooks.phase."""
    from .hooks.phase import phase as _phase

    return _phase(name)


def phase_heartbeat() -> None:
    """A sign of life inside a phase (throttled; nothing outside one); see ckptsup.hooks.phase."""
    from .hooks.phase import phase_heartbeat as _beat

    _beat()


def __getattr__(name: str) -> Any:
    # `heartbeat` is the hooks' own function, bound here on first use: a wrapper would add a
    # function call and an import to every step of a script run without the supervisor, whose
    # every heartbeat() is meant to cost one check.
    if name == "heartbeat":
        from .hooks.heartbeat import heartbeat

        globals()["heartbeat"] = heartbeat
        return heartbeat
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
