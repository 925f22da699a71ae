"""Creating communicators: ``ringattn.init``.

A communicator (``ringattn.Comm``, a C type) joins the ranks of a job.  Its
``sendrecv(send, dst, recv, src)`` moves one block in both directions at
once, which is all the ring needs; ``barrier()`` and ``allgather(bytes)``
cover the rest.  Backends:

* ``host``: TCP between CPU ranks (processes, possibly on several machines);
* ``threads``: ranks that are threads of one process (``ThreadsGroup``),
  on host memory or, with ``ThreadsGroup(size, devices=[...])``, each on
  its CUDA device (device copies between ranks of one GPU, peer copies
  between GPUs, ordered on the GPU with events: no host wait per step);
* ``nccl``: GPUs: one NCCL communicator per rank on its own CUDA stream
  (NCCL is loaded at first use; ``auto`` picks it when a CUDA ``device`` is
  asked for and CUDA is available).
"""

import glob
import os
import site
import sys
import warnings

from . import _C
from ._C import Comm, CommError, ThreadsGroup
from .checks import timeout as _check_timeout

__all__ = ["init", "Comm", "CommError", "ThreadsGroup", "default_timeout",
           "nccl_unique_id", "nccl_version"]

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


_warned_unauthenticated = False


def _job_key(master_addr, port, world_size):
    """The token of a job started without RINGATTN_TOKEN: not a secret.

    It is built in the open from what every rank of the job shares (job id,
    master address and port, world size), so that two jobs that meet on one
    port by accident refuse each other.  It authenticates nothing: anyone
    who can see the job's environment can compute it.  One warning per
    process says so.
    """
    global _warned_unauthenticated
    job = (os.environ.get("TORCHELASTIC_RUN_ID") or
           os.environ.get("SLURM_JOB_ID") or
           os.environ.get("PBS_JOBID") or
           os.environ.get("LSB_JOBID") or "")
    if not _warned_unauthenticated:
        _warned_unauthenticated = True
        warnings.warn(
            f"ringattn: no RINGATTN_TOKEN (or token=) is set, so the host "
            f"transport at {master_addr}:{port} is unauthenticated: any "
            f"process that can reach that address can join the job, as with "
            f"torch's gloo and TCPStore.  Set RINGATTN_TOKEN to the same "
            f"random value on every rank (ra.launch and `ringattn launch` "
            f"do this for you).", RuntimeWarning, stacklevel=4)
    return f"unauthenticated|job={job}|{master_addr}:{port}|size={world_size}"


def _emu_nccl_library():
    """The emulated GPU's stand-in NCCL (ringattn/_emu_nccl*.so, built next
    to ringattn._C by ``RINGATTN_CUDA=emulate``), or None."""
    from importlib.machinery import EXTENSION_SUFFIXES

    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in EXTENSION_SUFFIXES:
        path = os.path.join(here, "_emu_nccl" + suffix)
        if os.path.isfile(path):
            return path
    return None


def _pip_nccl_library():
    """The NCCL library to fall back on after ``RINGATTN_NCCL_LIBRARY``:
    on the emulated GPU its stand-in NCCL (a real NCCL would look for a
    real GPU), otherwise libnccl.so.2 of the NVIDIA pip wheel
    (nvidia-nccl-cu*); None when there is none."""
    if getattr(_C, "cuda_emulated", lambda: False)():
        return _emu_nccl_library()
    roots = list(sys.path)
    try:
        roots += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:      # some virtualenvs lack these
        pass
    for root in roots:
        if not root or not os.path.isdir(os.path.join(root, "nvidia")):
            continue
        hits = sorted(glob.glob(os.path.join(root, "nvidia", "nccl*", "lib",
                                             "libnccl.so*")))
        if hits:
            return hits[0]
    return None


def nccl_version():
    """(major, minor, patch) of the NCCL ringattn would load, or None.

    Never raises: None when ringattn was built without CUDA or no NCCL
    library can be opened (``RINGATTN_NCCL_LIBRARY``, ``libnccl.so.2``, the
    NVIDIA pip wheel, in that order; on the emulated GPU
    ``RINGATTN_NCCL_LIBRARY``, then its stand-in NCCL).
    """
    try:
        return tuple(_C.nccl_version(library=_pip_nccl_library()))
    except Exception:
        return None


def nccl_unique_id():
    """A fresh NCCL unique id (128 bytes) to pass to every rank's
    ``init(backend="nccl", unique_id=...)``."""
    return _C.nccl_unique_id(library=_pip_nccl_library())


def _cuda_device_index(device):
    """None | int | 'cuda' | 'cuda:N' | ('cuda', N) -> CUDA index or None
    ('cpu' -> -1)."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise TypeError("device must be 'cpu', 'cuda', 'cuda:N', ('cuda', N) "
                        "or an int")
    if isinstance(device, int):
        index = device
    elif isinstance(device, tuple) and len(device) == 2:
        if device[0] == "cpu":
            return -1
        if device[0] != "cuda":
            raise ValueError(f"device: expected 'cpu' or 'cuda', got "
                             f"{device!r}")
        index = device[1]
    elif isinstance(device, str):
        kind, _, idx = device.partition(":")
        if kind == "cpu":
            return -1
        if kind != "cuda":
            raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', "
                             f"got {device!r}")
        try:
            index = int(idx) if idx else 0
        except ValueError:
            raise ValueError(f"device: bad index in {device!r}") from None
    else:
        raise TypeError(f"device must be 'cpu', 'cuda', 'cuda:N', "
                        f"('cuda', N) or an int, got {type(device).__name__}")
    if not isinstance(index, int) or index < 0:
        raise ValueError(f"device: expected a CUDA index >= 0, got {index!r}")
    return index


# launchers whose environment names this process's place in the job, in the
# order they are read: (name, rank, size, local rank, local size).  Slurm's
# job step (srun) is the launch: SLURM_NTASKS is the allocation's task count,
# also set in a batch script that runs one process, so the size is the
# step's (SLURM_STEP_NUM_TASKS) and a batch or extern step is no launch.
LAUNCHER_ENV = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MPICH/PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("Slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", None),
)

# SLURM_STEP_ID of the steps that are not srun launches: the batch script
# and the extern step (Slurm spells them by name or by their numeric ids)
SLURM_NON_LAUNCH_STEPS = ("batch", "extern", "4294967294", "4294967295")


def _slurm_batch_step():
    """True inside a Slurm batch script or extern step, not an srun step."""
    step = os.environ.get("SLURM_STEP_ID", os.environ.get("SLURM_STEPID"))
    return (os.environ.get("SLURM_STEP_NUM_TASKS") is None or
            (step or "").strip() in SLURM_NON_LAUNCH_STEPS)


def launcher_env():
    """This process's place in the job from the first launcher whose
    variables are set: {"launcher", "rank", "size", "local_rank",
    "local_size", "vars"} (local_* None where the launcher does not say),
    or None.  RANK / WORLD_SIZE (torchrun, ``ringattn launch``) come first,
    then Open MPI, MPICH/PMI and Slurm (an srun step; a batch script that
    runs one process is no launch)."""
    for name, rank_var, size_var, local_var, local_size_var in LAUNCHER_ENV:
        if name == "Slurm" and _slurm_batch_step():
            continue
        rank, size = _env_int(rank_var), _env_int(size_var)
        if rank is None and size is None:
            continue
        local_size = _env_int(local_size_var) if local_size_var else None
        if name == "Slurm" and _env_int("SLURM_STEP_NUM_NODES") == 1:
            local_size = size
        return {"launcher": name, "rank": rank, "size": size,
                "local_rank": _env_int(local_var),
                "local_size": local_size,
                "vars": f"{rank_var}={os.environ.get(rank_var)}, "
                        f"{size_var}={os.environ.get(size_var)}"}
    return None


def _default_cuda_device(rank):
    """This rank's GPU: the launcher's local rank (else rank) modulo the
    visible devices."""
    count = _C.cuda_device_count()
    env = launcher_env()
    local = env["local_rank"] if env else None
    index = local if local is not None else rank
    return index % count if count > 0 else 0


def _check_launcher_rendezvous(env, world_size, rendezvous):
    """An MPI or Slurm launcher starts the ranks but sets no rendezvous for
    ringattn: without one they would not find each other, so say which
    variables to set instead of waiting (or running N separate jobs)."""
    if (rendezvous is None or env is None or env["launcher"] == "torchrun"
            or world_size == 1):
        return
    master_addr, master_port = rendezvous
    has_port = (master_port is not None or _env_int("RINGATTN_MASTER_PORT")
                is not None or _env_int("MASTER_PORT") is not None)
    has_addr = master_addr is not None or bool(os.environ.get("MASTER_ADDR"))
    one_node = env["local_size"] is not None and env["local_size"] == world_size
    if has_port and (has_addr or one_node):
        return
    missing, example = [], []
    if not (has_addr or one_node):
        missing.append("MASTER_ADDR (rank 0's host)")
        example.append("-x MASTER_ADDR=host0")
    if not has_port:
        missing.append("MASTER_PORT (or RINGATTN_MASTER_PORT)")
        example.append("-x MASTER_PORT=29500")
    raise ValueError(
        f"{env['launcher']} started this process as rank {env['rank']} of "
        f"{world_size} ({env['vars']}), but ringattn's rendezvous is not "
        f"set: set {' and '.join(missing)} in every rank's environment "
        f"(e.g. mpirun {' '.join(example)}), or pass master_addr= / "
        f"master_port= to ra.init()")


def _rank_and_size(rank, world_size, rendezvous=None):
    """(rank, world_size) from the arguments or the launcher's environment
    (``launcher_env``); a single rank when neither says otherwise.
    rendezvous: (master_addr, master_port) arguments when this backend needs
    a host rendezvous, checked against an MPI/Slurm launch.  ValueError
    names what is wrong."""
    env = launcher_env()
    if world_size is None and env is not None:
        world_size = env["size"]
    if world_size is None:
        world_size = 1
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got "
                         f"{world_size!r}")
    if rank is None and env is not None:
        rank = env["rank"]
    if rank is None:
        if world_size != 1:
            raise ValueError(f"rank is required when world_size is "
                             f"{world_size} (pass rank= or set RANK)")
        rank = 0
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    _check_launcher_rendezvous(env, world_size, rendezvous)
    return rank, world_size


def _rendezvous(master_addr, master_port, token, world_size, no_port_msg):
    """(address, port, token) of the host rendezvous, from the arguments or
    MASTER_ADDR / RINGATTN_MASTER_PORT / MASTER_PORT+1 / RINGATTN_TOKEN."""
    if master_addr is None:
        master_addr = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = _rendezvous_port(master_port)
    if port is None:
        raise ValueError(no_port_msg)
    if not 0 < port < 65536:
        raise ValueError(f"master_port must be in 1..65535, got {port}")
    if token is None:
        token = os.environ.get("RINGATTN_TOKEN") or _job_key(
            master_addr, port, world_size)
    if not isinstance(token, str) or not token:
        raise ValueError("token must be a non-empty string")
    return master_addr, port, token


def _init_nccl(rank, world_size, device, unique_id, master_addr,
               master_port, token, timeout):
    own_id = unique_id is not None or bool(os.environ.get("NCCL_COMM_ID"))
    rank, world_size = _rank_and_size(
        rank, world_size, None if own_id else (master_addr, master_port))
    index = _cuda_device_index(device)
    if index == -1:
        raise ValueError("backend 'nccl' moves CUDA memory: device must be a "
                         "CUDA device, got 'cpu'")
    if index is None:
        index = _default_cuda_device(rank)
    library = _pip_nccl_library()
    if unique_id is None and os.environ.get("NCCL_COMM_ID"):
        # NCCL derives the id from NCCL_COMM_ID: every rank gets the same
        unique_id = _C.nccl_unique_id(library=library)
    if unique_id is not None or world_size == 1:
        return _C.nccl_comm(rank, world_size, index, unique_id=unique_id,
                            timeout=timeout, library=library)
    # launcher environment: rank 0's id travels over a host rendezvous
    master_addr, port, token = _rendezvous(
        master_addr, master_port, token, world_size,
        "backend 'nccl' with world_size > 1 needs unique_id="
        "ra.nccl_unique_id() shared by the ranks, NCCL_COMM_ID, or a "
        "rendezvous: master_port= / RINGATTN_MASTER_PORT / MASTER_PORT")
    return _C.nccl_comm(rank, world_size, index, master_addr=master_addr,
                        master_port=port, token=token, timeout=timeout,
                        library=library)


def init(backend="auto", rank=None, world_size=None, *, master_addr=None,
         master_port=None, token=None, timeout=None, device=None,
         unique_id=None, **kw):
    """Create this rank's communicator.

    Arguments left as None come from the launcher's environment (set by
    ``ringattn launch``, ``ra.launch``, torchrun, mpirun, srun, ...):

    * ``rank``, ``world_size``: ``RANK`` / ``WORLD_SIZE``, else Open MPI's
      ``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_SIZE``, else MPICH's
      ``PMI_RANK`` / ``PMI_SIZE``, else Slurm's ``SLURM_PROCID`` /
      ``SLURM_NTASKS`` (default: a single-rank communicator, where
      ``sendrecv`` to self is a copy).  MPI and Slurm set no rendezvous:
      under them set ``MASTER_PORT`` (or ``RINGATTN_MASTER_PORT``), and
      ``MASTER_ADDR`` when the ranks span machines; without them ``init``
      raises ValueError saying so;
    * ``master_addr``: ``MASTER_ADDR`` (default ``127.0.0.1``);
    * the rendezvous port: ``master_port`` if given, else
      ``RINGATTN_MASTER_PORT``, else ``MASTER_PORT + 1``.  ringattn never
      binds ``MASTER_PORT`` itself, because a foreign launcher's store (e.g.
      torchrun's) already listens there;
    * ``token``: ``RINGATTN_TOKEN``.  Every connection proves it (HMAC
      challenge-response both ways); connections without it are refused.
      ``ra.launch`` and ``ringattn launch`` always set a fresh random one.
      Without one the host transport is **unauthenticated** (as torch's
      gloo and TCPStore are): any process that can reach the rendezvous
      address can join, and a warning says so once per process.  The ranks
      then use a job key built in the open from the job id
      (``TORCHELASTIC_RUN_ID`` / ``SLURM_JOB_ID`` / ``PBS_JOBID`` /
      ``LSB_JOBID``), master address and port and world size; it only keeps
      two jobs that meet on one port by accident apart.  Even then nothing
      a peer sends is ever unpickled or evaluated.

    backend: ``"auto"`` (``"nccl"`` when ``device`` names a CUDA device and
    CUDA is available, else ``"host"``), ``"host"``, ``"threads"`` (pass
    ``group=ThreadsGroup(...)``; ranks are threads of this process),
    ``"nccl"`` (GPUs).

    nccl: ``device`` is this rank's GPU (``"cuda:N"``, ``("cuda", N)`` or
    ``N``; default the launcher's local rank (``LOCAL_RANK``,
    ``OMPI_COMM_WORLD_LOCAL_RANK``, ...) modulo the visible devices).  The ranks
    meet through, in order: ``unique_id`` (128 bytes from
    ``ra.nccl_unique_id()`` on one rank, shared by every rank),
    ``NCCL_COMM_ID``, or the host rendezvous above (rank 0 makes the id; the
    host connection stays for ``barrier``/``allgather``).  NCCL is loaded at
    first use: ``RINGATTN_NCCL_LIBRARY``, ``libnccl.so.2``, then the NVIDIA
    pip wheel (on the emulated GPU: ``RINGATTN_NCCL_LIBRARY``, then its
    stand-in NCCL, ringattn/_emu_nccl*.so).  ``sendrecv`` moves CUDA memory on the communicator's own
    stream ordered after ringattn's compute stream; ``Request.wait()``
    orders the compute stream after the transfer without blocking the host.
    A transfer not done within the timeout aborts the communicator; the next
    call raises ``CommError``.
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
    wants_cuda = _cuda_device_index(device) not in (None, -1)
    if backend == "auto":
        if group is not None:
            backend = "threads"
        elif wants_cuda:
            available, reason = _C.cuda_available()
            if not available:
                raise ValueError(f"device {device!r} needs CUDA, which is not "
                                 f"available: {reason}")
            backend = "nccl"
        else:
            backend = "host"
    if backend != "nccl" and unique_id is not None:
        raise ValueError(f"unique_id is for backend 'nccl', got backend "
                         f"{backend!r}")
    if backend == "threads" and wants_cuda:
        raise ValueError(f"backend 'threads' takes each rank's device from "
                         f"its group (ThreadsGroup(size, devices=[...])), "
                         f"not device=: got device={device!r}")
    if backend != "nccl" and wants_cuda:
        raise ValueError(f"backend {backend!r} moves host memory: device "
                         f"must be 'cpu' or None, got {device!r}")

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
        return _init_nccl(rank, world_size, device, unique_id, master_addr,
                          master_port, token, timeout)

    rank, world_size = _rank_and_size(rank, world_size,
                                      (master_addr, master_port))
    if world_size == 1:
        return _C.host_comm(0, 1, timeout=timeout)

    master_addr, port, token = _rendezvous(
        master_addr, master_port, token, world_size,
        "master_port is required when world_size > 1: pass master_port= or "
        "set RINGATTN_MASTER_PORT or MASTER_PORT")
    return _C.host_comm(rank, world_size, master_addr=master_addr,
                        master_port=port, token=token, timeout=timeout)
