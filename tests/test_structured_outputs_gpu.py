"""Structured outputs on a CUDA GPU: the bitmask unpacked on the device, decode steps replaying CUDA graphs (the mask
is applied to the logits after the graph), the Triton sampler, asynchronous scheduling (the previous step read back
while the forward runs) against synchronous, penalties and logprobs, in batches that mix constrained and free rows.
Skipped without CUDA; each engine runs in its own subprocess."""
import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest

from structured_schemas import all_schemas
from test_structured_outputs import tok_model_dir  # noqa: F401 -- the fixture, shared

pytestmark = [pytest.mark.gpu, pytest.mark.subprocess]

SCHEMAS = all_schemas()[::3]
REGEX = "[a-c]{2,4}-[0-9]{3}"
RUN = """
import json, sys
from nanovllm import LLM, SamplingParams, StructuredOutputsParams as S
model, kwargs, schemas, regex = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=S(json=s, disable_any_whitespace=True))
          for s in schemas]
params += [SamplingParams(temperature=0.8, seed=7, max_tokens=40, logprobs=3, presence_penalty=0.5,
                          structured_outputs=S(regex=regex)),
           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.2),
           SamplingParams(temperature=0.7, seed=3, max_tokens=24, ignore_eos=True)]
with LLM(model, **kwargs) as llm:
    outs = llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)
    print(json.dumps({"outputs": [[o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].token_ids]
                                  for o in outs], "graphs": len(llm.runner.graph_runner.decode_graphs)}))
"""


def run(model: str, **kwargs) -> dict:
    kwargs = {**dict(device="cuda", dtype="float32", kvcache_block_size=16, max_model_len=1024, max_num_seqs=64,
                     gpu_memory_budget_gib=6), **kwargs}  # a budget: xdist's workers may share the GPU
    proc = subprocess.run([sys.executable, "-c", RUN, model, json.dumps(kwargs), json.dumps(SCHEMAS), REGEX],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_constrained_batches_on_cuda_graphs_async_and_sync(tok_model_dir):  # noqa: F811 -- pytest's fixture
    runs = {mode: run(tok_model_dir, async_scheduling=mode) for mode in (True, False)}
    assert runs[True]["graphs"] > 0  # decode steps replayed graphs
    assert runs[True]["outputs"] == runs[False]["outputs"]
    outputs = runs[True]["outputs"]
    for schema, (text, reason, _) in zip(SCHEMAS, outputs):
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    text, reason, _ = outputs[len(SCHEMAS)]
    assert reason == "stop" and re.fullmatch(REGEX, text), text
    assert [len(ids) for _, _, ids in outputs[-2:]] == [24, 24]  # the free rows ran to max_tokens
