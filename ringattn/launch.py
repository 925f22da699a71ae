"""Starting ranks: ``ringattn.launch`` (a function per rank) and
``ringattn launch -n N script.py`` (a script per rank, torchrun-style).

``launch(fn, nprocs)`` runs ``fn(comm, *args)`` on every rank and returns
the results by rank.  With backend ``host`` the ranks are processes started
with multiprocessing's *spawn* context (``fn`` and ``args`` must pickle);
with ``threads`` they are threads of this process (what notebooks use).  If
a rank raises or dies, the others are stopped, nothing is left running, and
``LaunchError`` names the rank with its traceback (or exit code / signal).
"""

import argparse
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

from .checks import timeout as check_timeout
from .comm import CommError, ThreadsGroup, default_timeout, init

__all__ = ["launch", "main_launch", "LaunchError"]

# extra seconds the whole launch may take beyond one communicator timeout
TIMEOUT_MARGIN = 60.0
# seconds the other ranks get to finish on their own after a failure
# (they fail fast: the transport tells them), then SIGTERM, then SIGKILL
STOP_GRACE = 3.0
KILL_GRACE = 2.0


class LaunchError(RuntimeError):
    """A rank of ``launch`` raised, died or timed out.

    Attributes: ``rank`` (the root cause's rank), ``failures`` (one dict per
    failing rank: rank, kind = 'exception' | 'exit' | 'timeout', exc_type,
    message, traceback, exitcode).  ``__cause__`` is the rank's exception
    when it could be brought back.
    """

    def __init__(self, message, rank=None, failures=()):
        super().__init__(message)
        self.rank = rank
        self.failures = list(failures)


def free_port(host="127.0.0.1"):
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _check_launch_args(nprocs, backend, timeout):
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an integer >= 1, got {nprocs!r}")
    if backend not in ("auto", "host", "threads", "nccl"):
        raise ValueError(f"backend must be 'auto', 'host', 'threads' or "
                         f"'nccl', got {backend!r}")
    if timeout is None:
        return default_timeout() + TIMEOUT_MARGIN
    return check_timeout(timeout)


def _is_root_cause(f):
    return not (f["kind"] == "exception" and f["exc_type"] == "CommError")


def _raise_failures(failures, causes):
    """LaunchError for the root cause first, the other ranks after it."""
    failures = sorted(failures, key=lambda f: (not _is_root_cause(f),
                                               f["order"]))
    first = failures[0]
    lines = [_describe(first)]
    if first.get("traceback"):
        lines.append(first["traceback"].rstrip())
    for f in failures[1:]:
        lines.append("also " + _describe(f))
    err = LaunchError("\n".join(lines), rank=first["rank"], failures=failures)
    cause = causes.get(first["rank"])
    if cause is not None:
        raise err from cause
    raise err


def _describe(f):
    if f["kind"] == "exception":
        return f"rank {f['rank']} raised {f['exc_type']}: {f['message']}"
    if f["kind"] == "timeout":
        return f"rank {f['rank']} {f['message']}"
    code = f["exitcode"]
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"rank {f['rank']} was killed by signal {name}"
    return f"rank {f['rank']} exited with code {code} before returning"


# ---- processes ------------------------------------------------------------

def _check_gpus(nprocs):
    """nccl: one rank per visible GPU (several per GPU only where NCCL allows
    it: NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL >= 2.30)."""
    from . import _C

    available, reason = _C.cuda_available()
    if not available:
        raise ValueError(f"backend 'nccl' needs a CUDA device: {reason}")
    count = _C.cuda_device_count()
    if (nprocs > count and
            os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE", "") != "1"):
        raise ValueError(
            f"backend 'nccl' runs one rank per GPU: nprocs={nprocs} but "
            f"{count} GPU(s) are visible (CUDA_VISIBLE_DEVICES); set "
            f"NCCL_MULTI_RANK_GPU_ENABLE=1 to share GPUs (NCCL >= 2.30)")


def _rank_main(fn, rank, nprocs, port, token, args, conn, comm_timeout,
               backend="host"):
    """Body of one spawned rank: run fn, send ('ok', result) or the error.

    nccl: the rank's GPU is LOCAL_RANK modulo the visible devices.
    """
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1",
        "RINGATTN_MASTER_PORT": str(port), "RINGATTN_TOKEN": token,
    })
    try:
        try:
            comm = init(backend, rank, nprocs, master_addr="127.0.0.1",
                        master_port=port, token=token, timeout=comm_timeout)
            try:
                result = fn(comm, *args)
            except BaseException as e:
                comm.abort(f"rank {rank} raised {type(e).__name__}: {e}")
                raise
            finally:
                comm.close()
            payload = pickle.dumps(("ok", result))
        except BaseException as e:
            try:
                exc_blob = pickle.dumps(e)
            except Exception:
                exc_blob = None
            payload = pickle.dumps(("err", type(e).__name__, str(e),
                                    traceback.format_exc(), exc_blob))
        conn.send_bytes(payload)
    finally:
        conn.close()


def _launch_processes(fn, nprocs, args, timeout, backend="host"):
    try:
        pickle.dumps((fn, args))
    except Exception as e:
        raise ValueError(
            f"fn and args must pickle to run in spawned processes ({e}); "
            f"define fn at module level, or use backend='threads'") from e
    ctx = mp.get_context("spawn")
    port = free_port()
    token = secrets.token_hex(16)
    comm_timeout = min(default_timeout(), timeout)
    procs, conns = [], []
    results = [None] * nprocs
    failures, causes = [], {}
    answered = set()
    try:
        for rank in range(nprocs):
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, name=f"ringattn-rank-{rank}",
                            args=(fn, rank, nprocs, port, token, args,
                                  send_end, comm_timeout, backend))
            p.start()
            send_end.close()
            procs.append(p)
            conns.append(recv_end)
        deadline = time.monotonic() + timeout
        stop_at = None            # set at the first failure
        while len(answered) < nprocs:
            now = time.monotonic()
            if stop_at is not None and now >= stop_at:
                break
            if now >= deadline:
                for r in range(nprocs):
                    if r not in answered:
                        failures.append({
                            "rank": r, "kind": "timeout", "exc_type": None,
                            "message": f"did not finish within {timeout:.1f} s",
                            "traceback": "", "exitcode": None,
                            "order": len(failures)})
                break
            limit = min(deadline, stop_at or deadline) - now
            waitables = [conns[r] for r in range(nprocs) if r not in answered]
            waitables += [procs[r].sentinel for r in range(nprocs)
                          if r not in answered]
            ready = mp_connection.wait(waitables, timeout=min(limit, 1.0))
            for r in range(nprocs):
                if r in answered:
                    continue
                if conns[r] in ready or procs[r].sentinel in ready:
                    msg = _read_answer(conns[r], procs[r])
                    if msg is None:
                        continue
                    answered.add(r)
                    if msg[0] == "ok":
                        results[r] = msg[1]
                        continue
                    failures.append(_failure(r, msg, len(failures), causes))
                    if stop_at is None:
                        stop_at = time.monotonic() + STOP_GRACE
    finally:
        _stop_processes(procs)
        for c in conns:
            c.close()
    if failures:
        _raise_failures(failures, causes)
    return results


def _read_answer(conn, proc):
    """('ok', value), ('err', ...), ('exit', code), or None (still running)."""
    try:
        if conn.poll(0):
            return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        pass
    except Exception as e:     # the result does not unpickle here
        return ("err", type(e).__name__, f"cannot unpickle the result: {e}",
                traceback.format_exc(), None)
    if proc.exitcode is None:
        proc.join(0.05)
    if proc.exitcode is not None:
        return ("exit", proc.exitcode)
    return None


def _failure(rank, msg, order, causes):
    if msg[0] == "exit":
        return {"rank": rank, "kind": "exit", "exc_type": None,
                "message": "", "traceback": "", "exitcode": msg[1],
                "order": order}
    _, exc_type, text, tb, blob = msg
    if blob is not None:
        try:
            causes[rank] = pickle.loads(blob)
        except Exception:
            pass
    return {"rank": rank, "kind": "exception", "exc_type": exc_type,
            "message": text, "traceback": tb, "exitcode": None,
            "order": order}


def _stop_processes(procs):
    """Join every process: politely, then SIGTERM, then SIGKILL."""
    for p in procs:
        p.join(timeout=0 if p.exitcode is not None else 0.5)
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + KILL_GRACE
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


# ---- threads --------------------------------------------------------------

def _launch_threads(fn, nprocs, args, timeout, devices=None):
    group = ThreadsGroup(nprocs, timeout=min(default_timeout(), timeout),
                         devices=devices)
    results = [None] * nprocs
    failures, causes = [], {}
    lock = threading.Lock()

    def body(rank):
        comm = group.comm(rank)
        try:
            results[rank] = fn(comm, *args)
        except BaseException as e:
            with lock:
                failures.append({
                    "rank": rank, "kind": "exception",
                    "exc_type": type(e).__name__, "message": str(e),
                    "traceback": traceback.format_exc(), "exitcode": None,
                    "order": len(failures)})
                causes[rank] = e
            group.abort(f"rank {rank} raised {type(e).__name__}: {e}")
        finally:
            comm.close()

    threads = [threading.Thread(target=body, args=(r,), daemon=True,
                                name=f"ringattn-rank-{r}")
               for r in range(nprocs)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        group.abort(f"launch timed out after {timeout:.1f} s")
        for t in threads:
            t.join(STOP_GRACE)
        with lock:
            for r, t in enumerate(threads):
                if t.is_alive():
                    failures.append({
                        "rank": r, "kind": "timeout", "exc_type": None,
                        "message": f"did not finish within {timeout:.1f} s "
                                   f"(thread still running)",
                        "traceback": "", "exitcode": None,
                        "order": len(failures)})
    if failures:
        _raise_failures(failures, causes)
    return results


def launch(fn, nprocs, args=(), backend="auto", timeout=None, devices=None):
    """Run ``fn(comm, *args)`` on ``nprocs`` ranks; return results by rank.

    backend: ``"host"`` (``"auto"``): processes started with the spawn
    context, joined by a TCP communicator on loopback (free port, fresh
    random token; the environment ``ra.init()`` reads is set too); ``fn``,
    ``args`` and the results must pickle.  ``"threads"``: threads of this
    process sharing a ``ThreadsGroup`` (notebooks, closures).  ``"nccl"``:
    processes as for ``host``, one per visible GPU (rank r uses device
    ``r % device_count``, ``comm.device`` says which), joined by NCCL after
    a host rendezvous that hands out the unique id; several ranks per GPU
    only with ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (NCCL >= 2.30).

    devices (``"threads"`` only): one CUDA device per rank (an int,
    ``"cuda:N"`` or ``("cuda", N)``; ranks may share one), as in
    ``ThreadsGroup(nprocs, devices=...)``: the ranks then move CUDA arrays
    of their device.

    timeout: seconds for the whole launch (default ``RINGATTN_TIMEOUT`` +
    60).  Every communicator wait also has the ``RINGATTN_TIMEOUT``
    deadline (capped at ``timeout``).

    Raises ``LaunchError`` if a rank raises, dies or times out: the other
    ranks are stopped first and no process is left behind.
    """
    timeout = _check_launch_args(nprocs, backend, timeout)
    args = tuple(args)
    if devices is not None and backend != "threads":
        raise ValueError(f"devices is for backend 'threads', got backend "
                         f"{backend!r}")
    if backend == "threads":
        return _launch_threads(fn, nprocs, args, timeout, devices)
    if backend == "nccl":
        _check_gpus(nprocs)
        return _launch_processes(fn, nprocs, args, timeout, "nccl")
    return _launch_processes(fn, nprocs, args, timeout)


# ---- ringattn launch -n N script.py ----------------------------------------

def _launch_parser():
    from .cli import Parser, nonnegative_int, port, positive_float, positive_int

    p = Parser(
        prog="ringattn launch",
        description="Start N ranks of a Python script on this machine with "
                    "the environment ringattn.init() reads (RANK, WORLD_SIZE, "
                    "LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, "
                    "RINGATTN_MASTER_PORT, RINGATTN_TOKEN), torchrun-style.  "
                    "Several machines: run it on each with the same --nnodes, "
                    "--master-addr and --master-port and its own --node-rank "
                    "(global rank = node_rank * nprocs + local rank), and the "
                    "same RINGATTN_TOKEN secret in every node's environment.  "
                    "If one rank fails the others are stopped; the exit code "
                    "is the first failing rank's.")
    p.add_argument("-n", "--nprocs", "--nproc-per-node", dest="nprocs",
                   type=positive_int, required=True,
                   help="ranks on this machine")
    p.add_argument("--nnodes", type=positive_int, default=1,
                   help="machines in the job")
    p.add_argument("--node-rank", type=nonnegative_int, default=0,
                   help="this machine's index, 0 .. nnodes-1")
    p.add_argument("--master-addr", default=None,
                   help="address of the machine of rank 0, reachable from "
                        "every node (required with --nnodes > 1; default "
                        "127.0.0.1)")
    p.add_argument("--master-port", type=port, default=None,
                   help="port of rank 0's launcher rendezvous (MASTER_PORT; "
                        "ringattn's own is MASTER_PORT + 1); required with "
                        "--nnodes > 1 (default: a free port)")
    p.add_argument("--timeout", type=positive_float, default=None,
                   help="seconds before all ranks are stopped (default: none)")
    p.add_argument("-m", dest="module", default=None,
                   help="run a module (python -m) instead of a script")
    p.add_argument("script", nargs="?", help="the script to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="arguments passed to the script")
    return p


def _job_env(opts, parser):
    """The environment every rank of this node shares."""
    if opts.node_rank >= opts.nnodes:
        parser.error(f"argument --node-rank: must be below --nnodes "
                     f"{opts.nnodes}, got {opts.node_rank}")
    env = {
        "WORLD_SIZE": str(opts.nnodes * opts.nprocs),
        "LOCAL_WORLD_SIZE": str(opts.nprocs),
        "GROUP_RANK": str(opts.node_rank),
    }
    if opts.nnodes == 1:
        env["MASTER_ADDR"] = opts.master_addr or "127.0.0.1"
        env["MASTER_PORT"] = str(opts.master_port or free_port())
        env["RINGATTN_MASTER_PORT"] = str(free_port())
        env["RINGATTN_TOKEN"] = secrets.token_hex(16)
        return env
    # several machines: every node must agree on the rendezvous (ringattn's
    # port is MASTER_PORT + 1) and on the token, which therefore comes from
    # the environment (RINGATTN_TOKEN; without it ringattn.init() warns that
    # the transport is unauthenticated)
    for flag in ("master_addr", "master_port"):
        if getattr(opts, flag) is None:
            parser.error(f"argument --{flag.replace('_', '-')}: required "
                         f"with --nnodes {opts.nnodes} (the same on every "
                         f"node)")
    env["MASTER_ADDR"] = opts.master_addr
    env["MASTER_PORT"] = str(opts.master_port)
    return env


def main_launch(argv):
    """``ringattn launch -n N script.py [args...]``; returns the exit code."""
    parser = _launch_parser()
    opts = parser.parse_args(list(argv))
    if opts.module is None and opts.script is None:
        parser.error("a script (or -m module) is required")
    if opts.module is not None:
        target = ["-m", opts.module] + ([opts.script] if opts.script else [])
    else:
        target = [opts.script]
    cmd = [sys.executable] + target + list(opts.script_args)
    base_env = dict(os.environ)
    if opts.nnodes > 1:
        # a ringattn port inherited from elsewhere would differ per node
        base_env.pop("RINGATTN_MASTER_PORT", None)
    base_env.update(_job_env(opts, parser))
    first_rank = opts.node_rank * opts.nprocs
    procs = []
    exits = queue.Queue()       # (rank, code) in the order ranks ended
    first_bad = 0
    try:
        for local in range(opts.nprocs):
            rank = first_rank + local
            env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(local))
            procs.append(subprocess.Popen(cmd, env=env))
            threading.Thread(target=lambda r=rank, p=procs[-1]:
                             exits.put((r, p.wait())), daemon=True).start()
        deadline = (time.monotonic() + opts.timeout
                    if opts.timeout is not None else None)
        finished = 0
        while finished < opts.nprocs:
            wait = 0.5 if deadline is None else min(
                0.5, max(0.0, deadline - time.monotonic()))
            try:
                rank, code = exits.get(timeout=wait)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    print(f"ringattn launch: timed out after {opts.timeout} "
                          f"s; stopping the ranks", file=sys.stderr)
                    first_bad = 124
                    break
                continue
            finished += 1
            if code != 0:
                first_bad = _root_cause(rank, code, exits,
                                        opts.nprocs - finished)
                break
    except KeyboardInterrupt:
        first_bad = 130
    finally:
        _stop_popen(procs)
    return first_bad


def _root_cause(rank, code, exits, running, grace=2.0):
    """Exit code to report once `rank` failed with `code`.

    A rank that dies takes its peers down with it: they fail with a
    CommError a moment later, usually as an uncaught exception (exit code
    1), and may even finish first when the dying rank is slow to tear down.
    So collect the exits of the next `grace` seconds and prefer a failure
    that is not the generic code 1 (a specific exit code or a signal);
    among equals the first observed wins.
    """
    failures = [(rank, code)]
    end = time.monotonic() + grace
    while running > 0:
        left = end - time.monotonic()
        if left <= 0:
            break
        try:
            r, c = exits.get(timeout=left)
        except queue.Empty:
            break
        running -= 1
        if c != 0:
            failures.append((r, c))
    specific = [f for f in failures if f[1] != 1]
    root_rank, root_code = (specific or failures)[0]
    others = ", ".join(f"rank {r} ({c})" for r, c in failures
                       if r != root_rank)
    print(f"ringattn launch: rank {root_rank} exited with code {root_code}"
          + (f"; also failed: {others}" if others else "")
          + "; stopping the other ranks", file=sys.stderr)
    return _exit_code(root_code)


def _exit_code(code):
    return 128 - code if code < 0 else code


def _stop_popen(procs):
    end = time.monotonic() + STOP_GRACE
    for p in procs:
        if p.poll() is None:
            try:
                p.wait(max(0.0, min(0.5, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + KILL_GRACE
    for p in procs:
        try:
            p.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


if __name__ == "__main__":
    sys.exit(main_launch(sys.argv[1:]))
