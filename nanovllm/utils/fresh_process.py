"""A function run in a process of its own that does not pay the engine's imports again (about 2 CPU-seconds each:
torch, transformers, the model's config class). The process forks from multiprocessing's forkserver, which imports
those modules once and never touches CUDA, so each process still starts without CUDA state or an engine, and what
it allocates (GPU memory too) goes when it exits. verify_swap.py and the benchmarks run their checks and modes so.
The process gets the environment the forkserver started with (the first call's): os.environ changed after that
does not reach it."""
import multiprocessing

# what an engine's process imports before it builds one; the forkserver imports them when it starts (later preload
# lists do not change a forkserver that already runs: they only make it faster)
ENGINE_MODULES = ["nanovllm.llm", "transformers.models.auto.configuration_auto"]


def start_fresh_process(target, args=(), preload=()) -> multiprocessing.Process:
    """target(*args) in a new process, started; the caller joins it. preload: modules besides the engine's that the
    target imports (the forkserver also imports the main script, so its functions can be the target). Not
    daemonic: the target may start processes of its own (tensor-parallel workers)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", *ENGINE_MODULES, *preload])
    proc = ctx.Process(target=target, args=args)
    proc.start()
    return proc
