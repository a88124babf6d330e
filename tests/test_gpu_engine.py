"""The engine on a CUDA GPU: Triton attention, CUDA graphs, torch.compile and the copy streams against HF and
against the unpressured run. Skipped without CUDA; each engine runs in its own subprocess."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.subprocess]  # each engine runs in its own subprocess

PROMPT_LENS = (5, 40, 130, 300, 17, 77)
MAX_TOKENS = 48
GPU_BUDGET_GIB = 6  # each engine's budget, so that pytest-xdist's workers can share one GPU


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    """Head dims 64 and 128 (the Triton kernels' main cases), GQA, one per family."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
    common = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  initializer_range=0.3)
    configs = {"qwen3": Qwen3Config(**common, head_dim=128, tie_word_embeddings=True),
               "qwen2": Qwen2Config(**common, tie_word_embeddings=True),
               "llama": LlamaConfig(**common, tie_word_embeddings=False)}
    root = tmp_path_factory.mktemp("gpu_models")
    dirs = {}
    for i, (name, config) in enumerate(configs.items()):
        torch.manual_seed(i)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


RUN = """
import json, random, sys
import torch
from nanovllm import LLM, SamplingParams
model, kwargs, reference = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "hf"
rng = random.Random(0)
prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in %s]
if reference:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).cuda().eval()
    outs = []
    for p in prompts:
        o = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=%d, do_sample=False, eos_token_id=None,
                        pad_token_id=0)
        outs.append(o[0, len(p):].tolist())
    print(json.dumps({"token_ids": outs}))
else:
    with LLM(model, **kwargs) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=%d, ignore_eos=True), use_tqdm=False)
        print(json.dumps({"token_ids": [o["token_ids"] for o in outs], "stats": llm.stats(),
                          "backend": llm.runner.backend.name, "graphs": len(llm.runner.graph_runner.decode_graphs)}))
""" % (PROMPT_LENS, MAX_TOKENS, MAX_TOKENS)


def run(model: str, reference: bool = False, env: dict | None = None, script: str = RUN, **kwargs) -> dict:
    # max_num_seqs 8 (the runs have 6 prompts): 4 decode graphs to capture at start-up instead of ~25; batches of
    # 5-6 rows still replay a padded graph
    kwargs = {**dict(device="cuda", dtype="float32", kvcache_block_size=16, max_model_len=1024, max_num_seqs=8,
                     gpu_memory_budget_gib=GPU_BUDGET_GIB), **kwargs}
    proc = subprocess.run([sys.executable, "-c", script, model, json.dumps(kwargs), "hf" if reference else "engine"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def num_same(a, b) -> int:
    return sum(x == y for x, y in zip(a, b))


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_triton_graphs_compile_match_hf_in_float32(gpu_models, family):
    ref = run(gpu_models[family], reference=True)["token_ids"]
    got = run(gpu_models[family])
    assert got["backend"] == "triton" and got["graphs"] > 0
    assert num_same(got["token_ids"], ref) == len(ref), (got["token_ids"], ref)


@pytest.mark.parametrize("env", [{}, {"NANOVLLM_PIECEWISE_GRAPHS": "0"}], ids=["default", "no_piecewise_graphs"])
def test_mixed_steps_match_hf_in_float32(gpu_models, env):
    """A 64-token budget: prompts prefill in chunks beside the other sequences' decodes. By default a mixed step
    replays piecewise graphs, and its one-token rows go through the decode kernel, the chunks through prefill."""
    ref = run(gpu_models["qwen3"], reference=True)["token_ids"]
    got = run(gpu_models["qwen3"], env=env, max_num_batched_tokens=64)
    assert num_same(got["token_ids"], ref) == len(ref), (got["token_ids"], ref)


FULL_BATCH_RUN = """
import json, random, sys
import torch
from nanovllm import LLM, SamplingParams
model, kwargs = sys.argv[1], json.loads(sys.argv[2])
rng = random.Random(2)
prompts = [[rng.randrange(3, 1024) for _ in range(rng.randint(5, 200))] for _ in range(kwargs.pop("num_prompts"))]
with LLM(model, **kwargs) as llm:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"token_ids": [o["token_ids"] for o in outs], "backend": llm.runner.backend.name,
                      "graphs": sorted(llm.runner.graph_runner.decode_graphs)}))
"""


def test_full_gpu_decode_batch_matches_the_torch_backend(gpu_models):
    """Enough rows that a decode launch fills the GPU without splitting (rows x kv heads >= 4 programs per SM;
    the per-row plan once gave such a launch a 0-token slice, caught only by a benchmark) and decode graphs past
    256 rows, ragged contexts: greedy float32 tokens equal the torch reference backend's on the same GPU."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    num_prompts = -(-4 * num_sms // 2) + 36  # the tiny models have 2 kv heads
    # one prefill step for all prompts, then 7 decode steps of every row
    kwargs = dict(num_prompts=num_prompts, max_num_seqs=num_prompts, max_num_batched_tokens=65536)
    ref = run(gpu_models["qwen3"], script=FULL_BATCH_RUN, attention_backend="torch", **kwargs)
    got = run(gpu_models["qwen3"], script=FULL_BATCH_RUN, **kwargs)
    assert ref["backend"] == "torch" and got["backend"] == "triton" and got["graphs"][-1] == num_prompts
    assert len(got["token_ids"]) == num_prompts and all(len(t) == 8 for t in got["token_ids"])
    assert got["token_ids"] == ref["token_ids"]

def test_swap_on_cuda_streams_matches_the_unpressured_run(gpu_models):
    model = gpu_models["qwen3"]
    base = run(model, enforce_eager=True)["token_ids"]
    swap = run(model, num_kvcache_blocks=24, preemption_mode="swap", swap_space=0.5, enforce_eager=True)
    assert swap["token_ids"] == base
    s = swap["stats"]
    assert s["preemptions_swap"] > 0 and s["blocks_swapped_in"] > 0 and s["recomputed_tokens"] == 0
    assert s["swap_seconds"] > 0 and s["swap_exposed_seconds"] <= s["swap_seconds"] + 1e-3


def test_recompute_on_cuda_matches_the_unpressured_run(gpu_models):
    model = gpu_models["llama"]
    base = run(model, enforce_eager=True)["token_ids"]
    rec = run(model, num_kvcache_blocks=24, preemption_mode="recompute", enforce_eager=True)
    assert rec["token_ids"] == base and rec["stats"]["preemptions_recompute"] > 0


HOST_CACHE_RUN = """
import json, random, sys
from nanovllm import LLM, SamplingParams
model, kwargs = sys.argv[1], json.loads(sys.argv[2])
rng = random.Random(1)
prefix = [rng.randrange(3, 1024) for _ in range(96)]
prompts = [prefix + [rng.randrange(3, 1024) for _ in range(n)] for n in (5, 9, 3, 12)]
with LLM(model, **kwargs) as llm:
    outs = []
    for i, prompt in enumerate(prompts):
        outs.append(llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                 use_tqdm=False)[0]["token_ids"])
        # all 24 GPU blocks: evicts the shared prefix from the GPU, so the next prompt finds it on the host
        llm.generate([[7 + i] * 370], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"token_ids": outs, "stats": llm.stats()}))
"""


def test_host_prefix_cache_on_cuda_streams_gives_the_same_tokens(gpu_models):
    """The host tier as a prefix cache: evicted prefix blocks are written back to pinned memory on the copy stream
    and copied in again for the next prompt; its tokens equal a run without any prefix caching."""
    def host_cache_run(**kwargs):
        return run(gpu_models["qwen3"], script=HOST_CACHE_RUN, num_kvcache_blocks=24, swap_space=0.5, **kwargs)
    base = host_cache_run(enable_prefix_caching=False)
    got = host_cache_run(host_cache_policy="write_back")
    assert got["token_ids"] == base["token_ids"]
    s = got["stats"]
    assert s["host_prefix_hit_tokens"] == 3 * 96 and s["blocks_onloaded"] == 3 * 6 and s["blocks_offloaded"] > 0


NO_COMPILE_AFTER_WARMUP = """
import json, logging, random, sys
import torch, triton
from nanovllm import LLM, SamplingParams
compiles = []
class Recompiles(logging.Handler):
    def emit(self, record):
        compiles.append("torch.compile: " + record.getMessage().splitlines()[0])
rng = random.Random(0)
with LLM(sys.argv[1], device="cuda", dtype="bfloat16", kvcache_block_size=16, max_model_len=1024,
         max_num_batched_tokens=512, gpu_memory_budget_gib=%d) as llm:
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(Recompiles())
    triton.knobs.runtime.jit_cache_hook = lambda *a, **kw: compiles.append("triton: " + kw["repr"][:200]) and False
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randint(5, 400))] for _ in range(40)]
    llm.generate(prompts, SamplingParams(temperature=0.6, max_tokens=32, ignore_eos=True), use_tqdm=False)
print(json.dumps(compiles))
""" % GPU_BUDGET_GIB


def test_no_compile_after_warmup(gpu_models):
    """A run's first steps must not JIT-compile: the warm-up covers the sampler at the LM head's dtype and the
    kernels' variants in eager mixed steps (both once cost 0.2-2.6 s inside a timed H200 run)."""
    proc = subprocess.run([sys.executable, "-c", NO_COMPILE_AFTER_WARMUP, gpu_models["qwen3"]],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_fp8_triton_engine_matches_the_torch_backend_in_float32(gpu_models):
    """FP8 KV on the GPU: the Triton store (fused q/k norm + rope + rotation + quantization), prefill and decode
    kernels under CUDA graphs give the torch backend's greedy tokens (its store writes the same bytes; its
    attention dequantizes), in float32 compute, with a budget that makes mixed steps. (e5m2 differs only in the
    conversion, which tests/test_fp8_kv.py checks byte for byte on the GPU.)"""
    kwargs = dict(kv_cache_dtype="fp8_e4m3", max_num_batched_tokens=64)
    ref = run(gpu_models["qwen3"], attention_backend="torch", enforce_eager=True, **kwargs)
    got = run(gpu_models["qwen3"], **kwargs)
    assert got["backend"] == "triton" and got["graphs"] > 0
    assert got["token_ids"] == ref["token_ids"], (got["token_ids"], ref["token_ids"])


FORCED_SWAPS = """
import json, random, sys
sys.path.insert(0, %r)
from conftest import run_with_forced_swaps
from nanovllm import LLM, SamplingParams
model, kwargs = sys.argv[1], json.loads(sys.argv[2])
rng = random.Random(0)
prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in %s]
with LLM(model, **kwargs) as llm:
    params = SamplingParams(temperature=0, max_tokens=%d, ignore_eos=True)
    token_ids, batches = run_with_forced_swaps(llm, prompts, params)
    print(json.dumps({"token_ids": token_ids, "batches": batches, "stats": llm.stats()}))
""" % (os.path.dirname(os.path.abspath(__file__)), PROMPT_LENS, MAX_TOKENS)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_swap_on_cuda_streams_matches_a_run_with_the_same_batches(gpu_models, kv_cache_dtype):
    """FP8 blocks (values and their scales, one contiguous chunk) through the pinned host pool and back: the
    resumed sequences continue exactly as in a run whose blocks never left the GPU. FP8 output depends on the batch
    composition (one float bit of K in another batch shape can flip an FP8 byte: e5m2 did, under natural
    pressure), so both runs swap the same sequences at the same steps (conftest.run_with_forced_swaps) and only
    the tier differs: the reference's blocks stay cached on the GPU, the other's all come back from the host."""
    model = gpu_models["qwen3"]
    common = dict(kv_cache_dtype=kv_cache_dtype, preemption_mode="swap", async_scheduling=False, swap_space=0.5)
    base = run(model, script=FORCED_SWAPS, host_cache_policy="off", **common)
    swap = run(model, script=FORCED_SWAPS, enable_prefix_caching=False, **common)
    assert swap["batches"] == base["batches"]
    assert swap["token_ids"] == base["token_ids"]
    assert base["stats"]["blocks_swapped_in"] == 0, base["stats"]
    s = swap["stats"]
    assert s["preemptions_swap"] > 0 and s["blocks_swapped_in"] > 0 and s["recomputed_tokens"] == 0, s


STACK = """
import json, sys
import torch
from nanovllm import LLM, SamplingParams
from nanovllm.engine.memory_profile import stack_limit_bytes
with LLM(sys.argv[1], device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=8,
         gpu_memory_budget_gib=%d) as llm:
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"token_ids": out[0]["token_ids"], "non_torch": llm.memory_breakdown["non_torch"],
                      "stack_limit": stack_limit_bytes(llm.runner.device)}))
""" % GPU_BUDGET_GIB


def test_released_stack_reservation_goes_to_the_kv_cache(gpu_models):
    """The engine sets CUDA's per-thread stack limit to 0 at start-up (the driver raises it for a kernel that needs
    one): CUDA's own memory at sizing drops by most of stack limit x resident threads, and the tokens stay. In
    bfloat16, the dtype a GPU runs (float32 tiles may spill registers, and a kernel that spills raises the limit)."""
    def start(env):
        proc = subprocess.run([sys.executable, "-c", STACK, gpu_models["qwen3"]], capture_output=True, text=True,
                              timeout=600, env={**os.environ, **env})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])
    kept, released = start({"NANOVLLM_CUDA_STACK": "0"}), start({})
    assert released["token_ids"] == kept["token_ids"]
    assert released["stack_limit"] < kept["stack_limit"], (released, kept)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # CUDA's own memory is device-wide free memory: engines of other workers on this GPU would count
    props = torch.cuda.get_device_properties(0)
    threads = props.multi_processor_count * props.max_threads_per_multi_processor
    freed = (kept["stack_limit"] - released["stack_limit"]) * threads
    assert kept["non_torch"] - released["non_torch"] >= freed // 2, (kept, released, freed)


PENALTIES = """
import json, sys
from nanovllm import LLM, SamplingParams
prompts = [[5, 6, 7, 8] * 5, [9, 10, 11], [12] * 30]
penalized = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, repetition_penalty=1.5,
                           frequency_penalty=0.5, presence_penalty=0.3)
plain = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
with LLM(sys.argv[1], device="cuda", dtype="float32", max_model_len=1024, max_num_seqs=8,
         gpu_memory_budget_gib=%d, async_scheduling=sys.argv[2] == "1") as llm:
    outs = llm.generate(prompts + prompts, [penalized] * 3 + [plain] * 3, use_tqdm=False)
    print(json.dumps([o["token_ids"] for o in outs]))
""" % GPU_BUDGET_GIB


def test_penalties_on_cuda_with_and_without_async_scheduling(gpu_models):
    """Penalized rows beside plain ones under CUDA graphs: the placeholders of asynchronous scheduling are filled
    from the device's last sampled ids, so both loops give the same tokens, and the penalties change them."""
    def start(async_scheduling):
        proc = subprocess.run([sys.executable, "-c", PENALTIES, gpu_models["qwen3"], async_scheduling],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])
    on, off = start("1"), start("0")
    assert on == off
    assert on[:3] != on[3:]
