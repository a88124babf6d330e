"""The progress bar's rates: generate()'s tqdm postfix, refreshed twice a second from the engine's counters."""
import time
from collections.abc import Callable


def update_bar(bar, last: tuple[float, dict], read_stats: Callable[[], dict], num_swapped: int) -> tuple[float, dict]:
    """last: (time, stats) at the last refresh; returns the new pair (the old one while under half a second, so the
    counters are read at most twice a second)."""
    now = time.perf_counter()
    seconds = now - last[0]
    if seconds < 0.5:
        return last
    stats, prev = read_stats(), last[1]
    swap_bytes = stats["bytes_swapped_out"] + stats["bytes_swapped_in"] - prev["bytes_swapped_out"] \
        - prev["bytes_swapped_in"]
    bar.set_postfix_str(
        f"prefill={(stats['prefill_tokens'] - prev['prefill_tokens']) / seconds:.0f}tok/s "
        f"decode={(stats['decode_tokens'] - prev['decode_tokens']) / seconds:.0f}tok/s "
        f"swap={swap_bytes / seconds / 1e9:.2f}GB/s swapped={num_swapped}", refresh=False)
    return now, stats
