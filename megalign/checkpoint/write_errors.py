"""What went wrong when a checkpoint could not be written, in words: the file and the cause (ENOSPC, EACCES).

Why this exists: torch.distributed.checkpoint reports a failed write as a `CheckpointException` holding
each rank's error, and a full disk often surfaces there not as an OSError but as the zip writer's
`unexpected pos 704 vs 598` (torch.save noticed a short write, not why). So the cause is found again
where it lives: the rank's own OSError when it has one (its errno and file), else a probe file
written into the checkpoint folder, which fails the same way (ENOSPC on a full disk, EACCES on a
folder that stopped being writable, EDQUOT over a quota) and gives its errno; the file named is the
rank's shard (`__<rank>_*.distcp`) written last.
"""
from __future__ import annotations

import errno
import glob
import os
from typing import Optional


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written; `errno` is the cause found (module doc), the message names the file."""


def _probe(folder: str) -> Optional[OSError]:
    """The OSError that writing a small file into `folder` raises now, or None when it can be written."""
    path = os.path.join(folder, f".write-probe.{os.getpid()}")
    try:
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return exc
    finally:
        try:
            os.remove(path)
        except OSError:
            pass
    return None


def _cause(exc: BaseException, folder: str) -> Optional[OSError]:
    """The OSError behind `exc`: itself, one in its cause chain, else the probe's (module doc)."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return seen
        seen = seen.__cause__ or seen.__context__
    return _probe(folder)


def _last_shard(folder: str, rank: int) -> str:
    shards = sorted(glob.glob(os.path.join(folder, f"__{rank}_*.distcp")), key=os.path.getmtime)
    return shards[-1] if shards else folder


def describe_write_failure(exc: BaseException, folder: str, step: int) -> CheckpointWriteError:
    """A `CheckpointWriteError` for checkpoint `step`, whose files were being written into `folder`, from the
    exception the write raised (a DCP `CheckpointException`, whose `failures` maps each failed rank to its error
    and traceback, or a plain exception of this rank)."""
    failures = getattr(exc, "failures", None) or {None: (exc, None)}
    parts, code = [], 0
    for rank, failure in sorted(failures.items(), key=lambda item: -1 if item[0] is None else item[0]):
        error = failure[0] if isinstance(failure, tuple) else failure
        cause = _cause(error, folder)
        where = f"rank {rank}: " if rank is not None else ""
        if cause is not None:
            code = code or cause.errno
            name = errno.errorcode.get(cause.errno, str(cause.errno))
            file = cause.filename or (_last_shard(folder, rank) if rank is not None else folder)
            parts.append(f"{where}{file}: {name} ({os.strerror(cause.errno)})")
        else:
            parts.append(f"{where}{type(error).__name__}: {error}")
    return CheckpointWriteError(code, f"cannot write the checkpoint of step {step}: {'; '.join(parts)}. Nothing was "
                                      f"renamed into place: the earlier checkpoints are intact")
