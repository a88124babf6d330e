"""Tensor-parallel ranks 1..N-1, each a spawned process that owns one ModelRunner.

Rank 0 is the engine's own runner. Every call goes to all ranks in the same order: rank 0 sends it down the pipes,
runs it itself, then collects one reply per worker (an error reply is raised here, with the worker's traceback).
Workers ignore SIGINT, so a Ctrl-C reaches only the engine, which then shuts them down; they are daemons, so they
also die with the engine's process. Pipes carry the data: no shared memory to leak.

A worker that fails mid-step leaves rank 0 inside a collective: gloo notices the broken connection within
seconds, NCCL would wait for its 10-minute timeout. A watchdog thread therefore watches the workers: when one dies
or reports an error, it stops the others and aborts rank 0's NCCL process group, so the collective returns and
the worker's traceback reaches the caller. A step left half done on any rank leaves the ranks out of step, so the
pool is then shut down for good (every later call raises its failure).
"""
import copy
import multiprocessing as mp
import multiprocessing.connection
import signal
import socket
import threading
import time
import traceback
from types import SimpleNamespace

from nanovllm.config import Config
from nanovllm.utils.distributed import abort_process_group

WATCH_INTERVAL_S = 0.2  # how often the watchdog looks up from its wait to see whether the pool is closing
FAILURE_GRACE_S = 3.0  # after rank 0's step raised: how long a worker's failure may take to show (its cause)


def free_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def worker_config(config: Config) -> Config:
    """A copy of the config for the workers, its Hugging Face config a plain namespace of the same instance
    attributes (what pickling it would carry; the engine reads only those, with getattr). Unpickling transformers'
    config class in a spawned worker would import transformers: about a CPU-second of every rank's start."""
    copied = copy.copy(config)
    copied.hf_config = SimpleNamespace(**vars(config.hf_config))
    return copied


def _worker_main(config: Config, rank: int, conn, error_conn, init_method: str):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runner = None
    try:
        from nanovllm.engine.model_runner import ModelRunner
        runner = ModelRunner(config, rank, init_method)
        conn.send(("ok", None))
        while True:
            method, args = conn.recv()
            if method == "exit":
                break
            result = getattr(runner, method)(*args)
            conn.send(("ok", result))
    except EOFError:
        pass  # the engine is gone
    except BaseException:
        message = traceback.format_exc()
        _send_quietly(error_conn, message)  # first: the watchdog's channel, read even while rank 0 is in a collective
        _send_quietly(conn, ("error", message))
        runner = None  # exit without a teardown: a process group inside a broken collective may block in it
    finally:
        if runner is not None:
            runner.close()
        conn.close()


def _send_quietly(conn, message):
    try:
        conn.send(message)
    except OSError:  # rank 0 is gone or gave up on this worker
        pass


class WorkerPool:
    """The worker processes, their pipes and the watchdog.

    `failure` is None while every rank is in step; once set (by the watchdog, a reply, or a call that rank 0 left
    half done) the workers are stopped and every call raises it. NOTE: only the caller's thread reads `conns`;
    the watchdog reads only `error_conns` and the process sentinels.
    """

    def __init__(self, config: Config, init_method: str):
        ctx = mp.get_context("spawn")
        config = worker_config(config)
        self.conns, self.error_conns, self.procs = [], [], []
        for rank in range(1, config.tensor_parallel_size):
            parent, child = ctx.Pipe()
            error_parent, error_child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker_main, args=(config, rank, child, error_child, init_method), daemon=True,
                               name=f"nanovllm-tp{rank}")
            proc.start()
            child.close()
            error_child.close()
            self.conns.append(parent)
            self.error_conns.append(error_parent)
            self.procs.append(proc)
        self.failure: str | None = None
        self.is_closing = False
        self.is_call_outstanding = False  # a call was sent and its replies are not all in
        self._lock = threading.Lock()  # guards failure and is_closing
        self._procs_lock = threading.Lock()  # one thread at a time reaps the processes (join, exitcode)
        self._error_read_lock = threading.Lock()  # one thread at a time reads an error pipe (a message is read once)
        self._watchdog = threading.Thread(target=self._watch, name="nanovllm-tp-watchdog", daemon=True)
        self._watchdog.start()

    def send(self, method: str, *args):
        self._raise_failure()
        self.is_call_outstanding = True
        for conn in self.conns:
            conn.send((method, args))

    def wait(self) -> list:
        """One reply per worker; raises RuntimeError with the first worker's traceback on failure."""
        results = []
        for rank, conn in enumerate(self.conns, start=1):
            try:
                status, value = conn.recv()
            except (EOFError, OSError):
                self._fail(self._failure_of(rank))
                self._raise_failure()
            if status == "error":
                self._fail(f"tensor-parallel worker rank {rank} failed:\n{value}")
                self._raise_failure()
            results.append(value)
        self.is_call_outstanding = False
        return results

    def abandon_call(self, error: BaseException):
        """Rank 0 raised while a call was out (an error in its part of the step, a collective broken by a worker,
        or Ctrl-C): the ranks are out of step, so the pool is shut down. When a worker failed, that failure (its
        traceback) is raised instead of rank 0's error, which it caused."""
        if not self.is_call_outstanding or self.is_closing:
            return
        with self._lock:
            is_first = self.failure is None
        if is_first:  # after a Ctrl-C, a worker's failure is an unlikely cause: no grace period
            grace_s = 0 if isinstance(error, KeyboardInterrupt) else FAILURE_GRACE_S
            failed = multiprocessing.connection.wait(self._watched(), timeout=grace_s)
            rank = self._rank_of(failed[0]) if failed else None
            self._fail(self._failure_of(rank) if rank is not None else
                       f"a step failed on rank 0 while the workers were in it ({error!r}); the ranks are out of step")
        self._stop_processes()  # done, also when the watchdog started it
        if self.failure.startswith("tensor-parallel worker"):
            raise RuntimeError(self.failure) from error

    def close(self, timeout_s: float = 30.0):
        with self._lock:
            self.is_closing = True
        for conn in self.conns:
            _send_quietly(conn, ("exit", ()))
        with self._procs_lock:
            for proc in self.procs:
                proc.join(timeout_s)
        self._stop_processes()
        self._watchdog.join()
        for conn in self.conns + self.error_conns:
            conn.close()
        self.conns, self.error_conns = [], []

    # --- failures
    def _watched(self) -> list:
        return [proc.sentinel for proc in self.procs] + self.error_conns

    def _rank_of(self, ready) -> int:
        watched = self._watched()
        return watched.index(ready) % len(self.procs) + 1

    def _watch(self):
        """Waits for a worker to die or to report an error while the pool is open; then fails the pool."""
        while not self.is_closing and self.failure is None:
            ready = multiprocessing.connection.wait(self._watched(), timeout=WATCH_INTERVAL_S)
            with self._lock:
                if not ready or self.is_closing or self.failure is not None:
                    continue
            self._fail(self._failure_of(self._rank_of(ready[0])))
            abort_process_group()  # NCCL: returns rank 0 from the collective the dead worker never joins

    def _failure_of(self, rank: int) -> str:
        """What became of worker `rank`: its traceback when it sent one, else how its process ended."""
        error_conn, proc = self.error_conns[rank - 1], self.procs[rank - 1]
        with self._error_read_lock:
            try:
                if error_conn.poll(FAILURE_GRACE_S if proc.is_alive() else 0):
                    return f"tensor-parallel worker rank {rank} failed:\n{error_conn.recv()}"
            except (EOFError, OSError):  # it died without a message (or another thread read it)
                pass
        with self._procs_lock:
            proc.join(FAILURE_GRACE_S)
            code = proc.exitcode
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else
               f"exit code {code}" if code is not None else "no reply")
        return f"tensor-parallel worker rank {rank} died ({how})"

    def _fail(self, failure: str):
        """Record the first failure and stop every worker (the others sit in collectives that cannot complete)."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = failure
        self._stop_processes()

    def _stop_processes(self):
        with self._procs_lock:
            for proc in self.procs:
                if proc.is_alive():
                    proc.kill()  # SIGKILL: a worker inside a collective does not run a SIGTERM handler's Python code
            deadline = time.monotonic() + 10
            for proc in self.procs:
                proc.join(max(deadline - time.monotonic(), 0))

    def _raise_failure(self):
        if self.failure is not None:
            self._stop_processes()  # done, also when the watchdog started it
            raise RuntimeError(self.failure + "\nthe tensor-parallel workers are stopped; create a new LLM")
