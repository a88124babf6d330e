"""Agent replay: a tool-using agent session replayed through /v1/messages (Anthropic's Messages API, streamed), with
and without the host tier, reporting the share of prompt tokens computed after turn 1 and the median time to first
token. The issue's target: after turn 1, at most 25% of the prompt tokens computed with the host tier, inside an
8 GiB budget with the Qwen3-1.7B shape.

The session (random.Random(4), scaled by --token-scale): a system prompt of about 20k tokens (instructions and 24
tool definitions, as a coding agent sends them), a task, then per turn the recorded assistant turn (a line of text
and a tool_use) and its tool_result (200-1,000 tokens). Request t sends the history through turn t-1 and asks for
--max-tokens more; the replay sends the recorded turns, not the model's answers (dummy weights answer noise), as a
harness replaying a log does. --num-sessions sessions share the system prompt and take turns, one request at a time,
so their histories together outgrow the GPU's KV: what the host tier keeps, the next turn does not compute again.

The model: a preset's shape with dummy weights (load_format="dummy"), or `tiny` (2 layers, for a CPU smoke run),
and a word-level tokenizer built here with a Qwen3-style chat template (tools, <tool_call>, <think>): one token per
word, so the prompt lengths are what the workload says. Each mode runs in its own process
(nanovllm.utils.fresh_process), with the server in that process (uvicorn on a loopback port). Per request it reads
the prompt tokens from message_start, the tokens computed from /metrics (nanovllm_prefill_tokens before and after:
requests run one at a time) and the time to the first event after the ping.

GPU (the issue's run):
  python -m benchmarks.bench_agent_replay --shape qwen3-1.7b --gpu-memory-gib 8
CPU smoke run (tests/test_bench_agent_replay.py):
  python -m benchmarks.bench_agent_replay --shape tiny --device cpu --token-scale 0.05 --num-sessions 2 \
      --max-tokens 8 --swap-space 1 --max-model-len 8192
"""
import argparse
import json
import os
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time

from benchmarks.agent_session import NUM_TOOLS, agent_session, build_model_dir
from nanovllm.utils.fresh_process import start_fresh_process

MODES = ["no_host_tier", "host_tier"]


def engine_options(mode: str, args) -> dict:
    """laptop-agent's two modes (bench_laptop.py): recompute and no host pool, or the host tier's prefix cache."""
    options = dict(load_format="dummy", max_model_len=args.max_model_len, max_num_batched_tokens=2048,
                   max_num_seqs=16, enforce_eager=args.enforce_eager or args.device == "cpu")
    if args.device == "cpu":
        options.update(device="cpu", dtype="float32", num_kvcache_blocks=args.cpu_kv_blocks, kvcache_block_size=16)
    elif args.gpu_memory_gib:
        options.update(gpu_memory_budget_gib=args.gpu_memory_gib)
    if mode == "no_host_tier":
        options.update(preemption_mode="recompute", swap_space=0, host_cache_policy="off")
    else:
        options.update(preemption_mode="auto", swap_space=args.swap_space, host_cache_policy="write_back")
    return options


def run_mode(mode: str, args) -> dict:
    """In the mode's process: an engine, the server in this process, the whole replay."""
    import httpx
    import uvicorn

    from nanovllm import LLM
    from nanovllm.entrypoints.server import build_app
    model = build_model_dir(args.shape, os.path.join(tempfile.gettempdir(), f"nanovllm-agent-replay-{args.shape}"))
    llm = LLM(model, **engine_options(mode, args))
    server = uvicorn.Server(uvicorn.Config(build_app(llm, "agent"), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            requests = replay(client, args)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        llm.close()
    return summarize(mode, requests)


def replay(client, args) -> list[dict]:
    """Every session's turn t, then turn t+1, ...; one request at a time."""
    sessions = [agent_session(s, args.num_turns, args.token_scale) for s in range(args.num_sessions)]
    requests = []
    for turn in range(args.num_turns):
        for s, session in enumerate(sessions):
            body = {"model": "agent", "max_tokens": args.max_tokens, "stream": True, "system": session["system"],
                    "tools": session["tools"], "messages": session["messages"][:1 + 2 * turn],
                    "temperature": 0.6}
            before = prefill_tokens(client)
            start = time.perf_counter()
            first_event_s, input_tokens = stream_message(client, body, start)
            computed = prefill_tokens(client) - before
            requests.append(dict(session=s, turn=turn + 1, prompt_tokens=input_tokens, computed=computed,
                                 ttft_s=first_event_s, seconds=time.perf_counter() - start))
            print(f"agent-replay: session {s} turn {turn + 1}: {input_tokens} prompt tokens, {computed} computed, "
                  f"first token {first_event_s * 1000:.0f} ms", flush=True)
    return requests


def stream_message(client, body: dict, start: float) -> tuple[float, int]:
    """(seconds to the first event after the ping, the prompt's tokens) of one streamed /v1/messages request."""
    first_s, input_tokens = None, 0
    with client.stream("POST", "/v1/messages", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"/v1/messages answered {response.status_code}: {response.read()[:500]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: "):])
            if event["type"] == "message_start":
                input_tokens = event["message"]["usage"]["input_tokens"]
            elif event["type"] == "error":
                raise RuntimeError(f"the stream failed: {event}")
            elif event["type"] != "ping" and first_s is None:
                first_s = time.perf_counter() - start
    return first_s, input_tokens


def prefill_tokens(client) -> int:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("nanovllm_prefill_tokens_total "):  # a Prometheus counter's name ends in _total
            return int(float(line.split()[1]))
    raise RuntimeError("/metrics has no nanovllm_prefill_tokens")


def summarize(mode: str, requests: list[dict]) -> dict:
    later = [r for r in requests if r["turn"] > 1]
    prompt, computed = sum(r["prompt_tokens"] for r in later), sum(r["computed"] for r in later)
    return dict(mode=mode, num_requests=len(requests), max_prompt_tokens=max(r["prompt_tokens"] for r in requests),
                prompt_tokens_after_turn_1=prompt, computed_after_turn_1=computed,
                computed_share_after_turn_1=computed / prompt if prompt else 0.0,
                median_ttft_s=statistics.median(r["ttft_s"] for r in requests),
                median_ttft_after_turn_1_s=statistics.median(r["ttft_s"] for r in later) if later else None,
                total_seconds=sum(r["seconds"] for r in requests), requests=requests)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="qwen3-1.7b", help="a preset (nanovllm/utils/presets.py) or `tiny`")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--gpu-memory-gib", type=float, default=8.0, help="the engine's GPU budget (0: the whole GPU)")
    p.add_argument("--swap-space", type=float, default=16.0, help="the host tier's GiB (host_tier mode)")
    p.add_argument("--num-sessions", type=int, default=4)
    p.add_argument("--num-turns", type=int, default=8)
    p.add_argument("--token-scale", type=float, default=1.0, help="multiplies every length of the session")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--cpu-kv-blocks", type=int, default=380,
                   help="KV blocks of 16 tokens on the CPU (--device cpu): fewer than the sessions' histories need")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def _mode_process(conn, mode: str, argv: list[str]):
    conn.send(run_mode(mode, parse_args(argv)))


def run_mode_in_own_process(mode: str, argv: list[str]) -> dict:
    recv, send = multiprocessing.Pipe(duplex=False)
    preload = ["httpx", "uvicorn", "nanovllm.entrypoints.server"]
    proc = start_fresh_process(_mode_process, (send, mode, argv), preload)
    send.close()
    try:
        result = recv.recv()
    except EOFError:  # the process ended without a result
        result = None
    proc.join()
    if result is None:
        raise RuntimeError(f"mode {mode} failed (exit code {proc.exitcode}; its traceback is on stderr)")
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    results = []
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise ValueError(f"--modes: {mode!r} is not one of {', '.join(MODES)}")
        results.append(run_mode_in_own_process(mode, argv))
    print(f"agent replay: {args.num_sessions} sessions x {args.num_turns} turns, {NUM_TOOLS} tools, "
          f"shape {args.shape}, token scale {args.token_scale}")
    for r in results:
        print(f"  {r['mode']:>13}: computed {r['computed_share_after_turn_1']:.1%} of the prompt tokens after turn 1 "
              f"({r['computed_after_turn_1']:,} of {r['prompt_tokens_after_turn_1']:,}); median time to first "
              f"token {r['median_ttft_s'] * 1000:.0f} ms ({(r['median_ttft_after_turn_1_s'] or 0) * 1000:.0f} ms "
              f"after turn 1); longest prompt {r['max_prompt_tokens']:,} tokens")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
