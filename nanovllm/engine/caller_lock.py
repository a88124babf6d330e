"""One caller at a time, and none after close: the engine's public calls run under one re-entrant lock.

vLLM's LLM is not thread-safe: two threads that call generate() at once interleave schedule() and step() on shared
state (a step could hand one call's outputs to the other). Here the second caller waits until the first call
returns. The lock is re-entrant, so generate() may call step() and add_request() (and chat() generate()). A stream
holds the lock while it computes each chunk, not while its consumer holds the chunk: another thread's call may run
between two chunks, and the stream still reads only its own requests.
"""
import functools
import threading


class CallerLock:
    """The lock and the closed flag of one engine. NOTE: `is_closed` only goes from False to True, under the lock."""

    def __init__(self):
        self.lock = threading.RLock()
        self.is_closed = False

    def check_open(self, method_name: str):
        if self.is_closed:
            raise RuntimeError(f"LLM.{method_name}: the engine is closed (close() was called); create a new LLM")


def one_caller(method):
    """Runs an engine method under its caller lock; RuntimeError once the engine is closed."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.caller_lock.lock:
            self.caller_lock.check_open(method.__name__)
            return method(self, *args, **kwargs)
    return locked


def one_caller_stream(method):
    """one_caller for a generator method: each chunk is computed under the lock (the first one refuses a closed
    engine); closing the stream early runs the method's clean-up under the lock, unless the engine was closed
    meanwhile (close() already dropped everything)."""
    @functools.wraps(method)
    def locked_stream(self, *args, **kwargs):
        guard = self.caller_lock
        inner = method(self, *args, **kwargs)
        try:
            while True:
                with guard.lock:
                    guard.check_open(method.__name__)
                    try:
                        chunk = next(inner)
                    except StopIteration:
                        return
                yield chunk
        finally:
            with guard.lock:
                if not guard.is_closed:
                    inner.close()
    return locked_stream


def closing(method):
    """For close(): runs under the lock (a call under way in another thread finishes first), then marks the engine
    closed, even when the clean-up raised."""
    @functools.wraps(method)
    def close(self, *args, **kwargs):
        with self.caller_lock.lock:
            try:
                return method(self, *args, **kwargs)
            finally:
                self.caller_lock.is_closed = True
    return close
