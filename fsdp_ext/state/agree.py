"""Make every rank fail together: a failure seen by one rank is raised on all of them.

File-system work in checkpointing often runs on one rank (rank 0 reads the metadata, publishes the
directory). If it fails there and the other ranks go on to the next collective, they wait forever.
These helpers always run one collective that carries the outcome, so every rank either proceeds
with the same result or raises.
"""
from __future__ import annotations

import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _picklable(exc: BaseException) -> BaseException:
    import pickle
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to round-trip: send the message instead
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def on_rank0(fn):
    """Run `fn()` on rank 0 only; every rank returns its result or raises its exception."""
    if not _distributed():
        return fn()
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - forwarded to every rank below
            box[0] = ("error", _picklable(exc))
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise value
    return value


def all_ok(error: BaseException | None) -> None:
    """Collective: raise on every rank if any rank passes an exception (the first rank's)."""
    if not _distributed():
        if error is not None:
            raise error
        return
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else _picklable(error))
    for rank, exc in enumerate(errors):
        if exc is not None:
            if error is not None:
                raise error
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"(raised on rank {rank})")
            raise exc
