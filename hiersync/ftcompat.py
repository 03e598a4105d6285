"""Every use hiersync makes of torchft's internals, in one place, each checked where it is read.

torchft has no public accessor for what the manager mode needs: the process group the Manager
reconfigures at each quorum, its timeouts, the state it has registered, the quorum's id. Each
is read here and nowhere else; a member that a torchft release renamed or removed raises a
:class:`RuntimeError` naming the installed torchft version, the member and the versions
hiersync is tested with, instead of an ``AttributeError`` deep inside a sync.

:func:`bounded` is how hiersync keeps a dead member of a quorum from costing the survivors
the timeout of the rail's data: while torchft configures the quorum's process group (its
store's connection, gloo's full mesh) and heals a joiner (the source's first answer, each read
of the state), the group's and the Manager's timeouts are the *contact* bound; the data
collectives of the window pass the long timeout themselves (:func:`op_timeout`).

:func:`abort_group` is how a node whose window failed lets its peers know at once: it drops
the quorum's group (torchft's ``abort()``), which closes its connections, so a peer waiting
on this node in the window's data fails on the closed connection instead of on that timeout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

__all__ = ["TESTED", "version", "process_group", "timeout", "quorum_timeout", "bounded", "op_timeout"]
__all__ += ["forget_failed_quorum", "registered_states", "unregister_state", "async_quorum", "quorum_id"]
__all__ += ["members", "check", "USED", "abort_group"]

TESTED = ("0.2.0", "nightly 2026.10.26")
"""The torchft releases the manager-mode tests run against (docs/fault-tolerance.md)."""


def version() -> str:
    """The installed torchft's version (the distribution's: ``torchft`` or ``torchft-nightly``)."""
    from importlib import metadata

    for dist in ("torchft", "torchft-nightly"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "torchft (version unknown)"


def _get(obj: Any, name: str, what: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise RuntimeError(
            f"hiersync: {type(obj).__name__}.{name} ({what}) is missing in {version()}: hiersync's manager mode is "
            f"tested with torchft {' and '.join(TESTED)}; install one of those, or report the version"
        ) from None


USED = {
    "_pg": "the process group torchft reconfigures",
    "_timeout": "the Manager's timeout",
    "_connect_timeout": "the Manager's connect timeout",
    "_quorum_timeout": "the Manager's quorum timeout",
    "_quorum_future": "the pending quorum",
    "_user_state_dicts": "the registered state_dict functions",
    "_load_state_dict_fns": "the registered load_state_dict functions",
    "_use_async_quorum": "whether the quorum is asynchronous",
    "_quorum_id": "the current quorum's id",
    "_group_world_size": "the ranks of a replica group",
}
"""The private members of ``torchft.Manager`` hiersync reads or sets, and what each is."""
USED_PG = {"_timeout": "the process group's timeout", "set_timeout": "the process group's set_timeout()"}


def check(manager: Any) -> None:
    """Refuse a ``torchft.Manager`` that lacks a member hiersync uses, naming it and the version (at
    ``register``, not at the first quorum). Objects that are not a ``torchft.Manager`` are left alone."""
    import torchft

    if not isinstance(manager, torchft.Manager):
        return
    for name, what in USED.items():
        _get(manager, name, what)
    pg = manager._pg
    if hasattr(pg, "configure"):  # a reconfigurable torchft group
        for name, what in USED_PG.items():
            _get(pg, name, what)


def process_group(manager: Any) -> Any:
    """The reconfigurable process group the Manager rebuilds at each quorum (the rail)."""
    return _get(manager, "_pg", "the process group torchft reconfigures")


def timeout(manager: Any) -> timedelta:
    """The Manager's timeout (a commit, a recovery)."""
    return _get(manager, "_timeout", "the Manager's timeout")


def quorum_timeout(manager: Any) -> timedelta:
    return _get(manager, "_quorum_timeout", "the Manager's quorum timeout")


def _pg_timeout(pg: Any) -> timedelta | None:
    return getattr(pg, "_timeout", None)  # a group without one (a test's fake) is left alone


@contextlib.contextmanager
def bounded(manager: Any, contact: timedelta) -> Iterator[None]:
    """Within: torchft's quorum configures its group and heals under ``contact``, not the long timeouts.

    The group's timeout (``set_timeout``, public) bounds its store client's connection and
    the rendezvous of a new group; the Manager's ``_timeout`` and ``_connect_timeout`` bound a
    joiner's first contact with its source and each read of the state (a socket timeout: a
    state that flows is not cut short, a dead or frozen source is). All are put back after.
    """
    pg = process_group(manager)
    saved_pg = _pg_timeout(pg)
    saved = {name: _get(manager, name, "a Manager's timeout") for name in ("_timeout", "_connect_timeout")}
    if saved_pg is not None:
        pg.set_timeout(min(contact, saved_pg))
    for name, value in saved.items():
        setattr(manager, name, min(contact, value))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(manager, name, value)
        if saved_pg is not None:
            pg.set_timeout(saved_pg)


@contextlib.contextmanager
def op_timeout(manager: Any, opts: Any, limit: timedelta | None) -> Iterator[None]:
    """Issue one rail collective under ``limit`` (None: the group's own timeout, the user's; the
    Manager's for a group without one): in its options (gloo reads them per operation; the group
    was built under the contact bound) and as the group's timeout while it is issued (torchft's
    NCCL group replaces the options' timeout with its own, read when it is issued)."""
    pg = process_group(manager)
    saved = _pg_timeout(pg)
    opts.timeout = limit or saved or timeout(manager)
    if saved is None:
        yield
        return
    pg.set_timeout(opts.timeout)
    try:
        yield
    finally:
        pg.set_timeout(saved)


def abort_group(manager: Any) -> None:
    """Drop the quorum's group (torchft's public ``abort()``; the next quorum builds a new one).

    On gloo the group's destruction closes its connections: a peer blocked in a collective
    with this node fails at once ("connection closed by peer"). On torchft's NCCL group it
    aborts the communicator (untested here: no GPU). torchft gives the next quorum a new id
    after a failed commit (it reconfigures even when nobody left), so nothing trains on a
    dropped group.
    """
    abort = getattr(process_group(manager), "abort", None)
    if abort is not None:  # a test's fake group may have none
        abort()


def forget_failed_quorum(manager: Any) -> None:
    """torchft re-raises a failed quorum at the next ``start_quorum``: forget it before asking again."""
    _get(manager, "_quorum_future", "the pending quorum")
    manager._quorum_future = None


def registered_states(manager: Any) -> dict[str, Any]:
    """The state_dict functions registered with the Manager, by key."""
    return dict(_get(manager, "_user_state_dicts", "the registered state_dict functions"))


def unregister_state(manager: Any, key: str) -> None:
    """Take ``key``'s state off the Manager (torchft has no call for it)."""
    for name in ("_load_state_dict_fns", "_user_state_dicts"):
        _get(manager, name, "the registered state_dict functions").pop(key, None)


def async_quorum(manager: Any) -> bool:
    return bool(getattr(manager, "_use_async_quorum", False))  # a fake without it is synchronous


def quorum_id(manager: Any) -> int:
    return int(getattr(manager, "_quorum_id", -1))


def members(manager: Any) -> list[int] | None:
    """The nodes in the current quorum (from the replica ids' numbers), or None if torchft does not say."""
    ranks = getattr(process_group(manager), "_global_ranks", None)
    size = max(1, int(getattr(manager, "_group_world_size", 1)))
    return sorted({int(r) // size for r in ranks}) if ranks else None


def participating_rank(manager: Any) -> int:
    """This node's place in the current quorum (its rank on the quorum's group; 0 if torchft does not say)."""
    rank = getattr(manager, "participating_rank", None)
    value = rank() if callable(rank) else None
    return int(value) if value is not None else 0
