"""Tensor-parallel ranks 1..N-1, each a spawned process that owns one ModelRunner.

Rank 0 is the engine's own runner. Every call goes to all ranks in the same order: rank 0 sends it down the pipes,
runs it itself, then collects one reply per worker (an error reply is raised here, with the worker's traceback).
Workers ignore SIGINT, so a Ctrl-C reaches only the engine, which then shuts them down; they are daemons, so they
also die with the engine's process. Pipes carry the data: no shared memory to leak.
"""
import multiprocessing as mp
import signal
import socket
import traceback

from nanovllm.config import Config


def free_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _worker_main(config: Config, rank: int, conn, init_method: str):
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
        conn.send(("error", traceback.format_exc()))
    finally:
        if runner is not None:
            runner.close()
        conn.close()


class WorkerPool:
    def __init__(self, config: Config, init_method: str):
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(1, config.tensor_parallel_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(config, rank, child, init_method), daemon=True,
                               name=f"nanovllm-tp{rank}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def send(self, method: str, *args):
        for conn in self.conns:
            conn.send((method, args))

    def wait(self) -> list:
        """One reply per worker; raises RuntimeError with the first worker's traceback on failure."""
        results = []
        for rank, conn in enumerate(self.conns, start=1):
            try:
                status, value = conn.recv()
            except EOFError:
                raise RuntimeError(f"tensor-parallel worker rank {rank} exited unexpectedly") from None
            if status == "error":
                raise RuntimeError(f"tensor-parallel worker rank {rank} failed:\n{value}")
            results.append(value)
        return results

    def close(self, timeout_s: float = 30.0):
        for conn in self.conns:
            try:
                conn.send(("exit", ()))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
