"""Creating communicators: ``ringattn.init``.

A communicator (``ringattn.Comm``, a C type) joins the ranks of a job.  Its
``sendrecv(send, dst, recv, src)`` moves one block in both directions at
once, which is all the ring needs; ``barrier()`` and ``allgather(bytes)``
cover the rest.  Backends:

* ``host``: TCP between CPU ranks (processes, possibly on several machines);
* ``threads``: ranks that are threads of one process (``ThreadsGroup``);
* ``nccl``: GPUs (not built yet; ``auto`` picks ``host`` for now).
"""

import hashlib
import os

from . import _C
from ._C import Comm, CommError, ThreadsGroup

__all__ = ["init", "Comm", "CommError", "ThreadsGroup", "default_timeout"]

BACKENDS = ("auto", "host", "threads", "nccl")


def default_timeout():
    """Seconds every communicator wait may take: ``RINGATTN_TIMEOUT`` or 300."""
    raw = os.environ.get("RINGATTN_TIMEOUT", "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if value > 0 and value != float("inf"):
            return value
    return 300.0


def _env_int(name):
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, "
                         f"got {raw!r}") from None


def _rendezvous_port(master_port):
    """Our rendezvous port: explicit > RINGATTN_MASTER_PORT > MASTER_PORT + 1."""
    if master_port is not None:
        return int(master_port)
    own = _env_int("RINGATTN_MASTER_PORT")
    if own is not None:
        return own
    launcher = _env_int("MASTER_PORT")
    if launcher is not None:
        return launcher + 1
    return None


def _derived_token(master_addr, port, world_size):
    """A job-wide token from what every rank of one job shares."""
    job = (os.environ.get("TORCHELASTIC_RUN_ID") or
           os.environ.get("SLURM_JOB_ID") or
           os.environ.get("PBS_JOBID") or
           os.environ.get("LSB_JOBID") or "")
    seed = f"ringattn|{job}|{master_addr}|{port}|{world_size}"
    return hashlib.sha256(seed.encode()).hexdigest()


def _check_timeout(timeout):
    if timeout is None:
        return None
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        raise TypeError(f"timeout must be a number of seconds or None, got "
                        f"{type(timeout).__name__}") from None
    if not value > 0:
        raise ValueError(f"timeout must be a positive number of seconds, "
                         f"got {timeout!r}")
    return value


def init(backend="auto", rank=None, world_size=None, *, master_addr=None,
         master_port=None, token=None, timeout=None, **kw):
    """Create this rank's communicator.

    Arguments left as None come from the launcher's environment (set by
    ``ringattn launch``, ``ra.launch``, torchrun, ...):

    * ``rank``: ``RANK`` (default 0 when ``world_size`` is 1);
    * ``world_size``: ``WORLD_SIZE`` (default 1: a single-rank communicator,
      where ``sendrecv`` to self is a copy);
    * ``master_addr``: ``MASTER_ADDR`` (default ``127.0.0.1``);
    * the rendezvous port: ``master_port`` if given, else
      ``RINGATTN_MASTER_PORT``, else ``MASTER_PORT + 1``.  ringattn never
      binds ``MASTER_PORT`` itself, because a foreign launcher's store (e.g.
      torchrun's) already listens there;
    * ``token``: ``RINGATTN_TOKEN``.  Every connection proves it (HMAC
      challenge-response both ways); connections without it are refused.
      ``ra.launch`` and ``ringattn launch`` always set a fresh random one.
      Without one, a token is derived from the job's environment
      (``TORCHELASTIC_RUN_ID`` / ``SLURM_JOB_ID`` / ``PBS_JOBID`` /
      ``LSB_JOBID``, master address and port, world size): it keeps other
      jobs out by accident, not an attacker who can read the environment;
      set ``RINGATTN_TOKEN`` for that.

    backend: ``"auto"`` (``"host"`` for now), ``"host"``, ``"threads"``
    (pass ``group=ThreadsGroup(...)``; ranks are threads of this process).
    timeout: default deadline in seconds of every wait of the communicator
    (default ``RINGATTN_TIMEOUT`` or 300).  ``init`` blocks until all ranks
    joined or the timeout passed (``CommError``).

    Returns a ``ringattn.Comm``.  Raises ``ValueError`` for bad arguments.
    """
    group = kw.pop("group", None)
    if kw:
        raise TypeError(f"init() got unexpected keyword argument(s): "
                        f"{', '.join(sorted(kw))}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, "
                         f"got {backend!r}")
    timeout = _check_timeout(timeout)
    if backend == "auto":
        backend = "threads" if group is not None else "host"

    if backend == "threads":
        if group is None:
            raise ValueError("backend 'threads' needs group=ThreadsGroup(size) "
                             "shared by the threads (or use ra.launch(..., "
                             "backend='threads'))")
        if rank is None:
            rank = _env_int("RANK")
        if rank is None:
            raise ValueError("rank is required for backend 'threads'")
        if world_size is not None and world_size != group.size:
            raise ValueError(f"world_size must match the group size "
                             f"{group.size}, got {world_size}")
        if not 0 <= rank < group.size:
            raise ValueError(f"rank must be in [0, {group.size}), got {rank}")
        return group.comm(rank)

    if backend == "nccl":
        raise ValueError("backend 'nccl' is not available in this build; "
                         "use 'host' or 'threads'")

    if world_size is None:
        world_size = _env_int("WORLD_SIZE")
    if world_size is None:
        world_size = 1
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got "
                         f"{world_size!r}")
    if rank is None:
        rank = _env_int("RANK")
    if rank is None:
        if world_size != 1:
            raise ValueError(f"rank is required when world_size is "
                             f"{world_size} (pass rank= or set RANK)")
        rank = 0
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if world_size == 1:
        return _C.host_comm(0, 1, timeout=timeout)

    if master_addr is None:
        master_addr = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = _rendezvous_port(master_port)
    if port is None:
        raise ValueError("master_port is required when world_size > 1: pass "
                         "master_port= or set RINGATTN_MASTER_PORT or "
                         "MASTER_PORT")
    if not 0 < port < 65536:
        raise ValueError(f"master_port must be in 1..65535, got {port}")
    if token is None:
        token = os.environ.get("RINGATTN_TOKEN") or _derived_token(
            master_addr, port, world_size)
    if not isinstance(token, str) or not token:
        raise ValueError("token must be a non-empty string")
    return _C.host_comm(rank, world_size, master_addr=master_addr,
                        master_port=port, token=token, timeout=timeout)
