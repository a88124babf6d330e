"""bench_swap.py's per-step timeline of a run (GPU and host blocks in use, bytes swapped, what each step computed)
and its plot (--plot, --save-timeline)."""
import time


class Timeline:
    """Per step: seconds since start, GPU blocks in use, host blocks in use, bytes swapped so far, and what the step
    computed: sequences, tokens."""

    def __init__(self, llm):
        self.points, self.start, step = [], time.perf_counter(), llm.step
        bm, host = llm.scheduler.block_manager, llm.scheduler.host_pool
        sched = llm.scheduler
        schedule, last = sched.schedule, {}

        def recorded_schedule():
            out = schedule()
            last["num_seqs"], last["num_tokens"] = len(out.seqs), sum(out.num_new_tokens)
            return out

        def timed_step():
            finished = step()
            host_used = sum(len(s.cpu_block_table) for s in sched.swapped) if host else 0
            swapped = ((sched.stats.blocks_swapped_out + sched.stats.blocks_swapped_in) * llm.block_bytes
                       * llm.config.tensor_parallel_size)  # all ranks, as stats() counts them
            self.points.append((time.perf_counter() - self.start, bm.num_blocks - bm.num_free_blocks,
                                host_used, swapped, last.get("num_seqs", 0), last.get("num_tokens", 0)))
            return finished
        sched.schedule = recorded_schedule
        llm.step = timed_step



def plot(scenario: str, results: list[dict], path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for r in results:
        t = [p[0] for p in r["timeline"]]
        for ax, i in zip(axes, (1, 2, 3)):
            ys = [p[i] / 1e9 if i == 3 else p[i] for p in r["timeline"]]
            ax.plot(t, ys, label=r["mode"])
    for ax, label in zip(axes, ("GPU blocks in use", "host blocks held by swapped seqs", "GB swapped (cumulative)")):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[-1].set_xlabel("seconds")
    fig.suptitle(f"bench_swap.py --scenario {scenario}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")
