"""The `nanovllm` command without loading a model: prompts and flags are checked before anything loads, the engine
flags come from Config, `generate` sizes the CPU caches for its work, `serve` names the model after its directory.

`FakeLLM` stands in for `nanovllm.LLM` (the CLI imports it when it runs), so these tests take milliseconds; the
real engine behind the CLI is tested in test_engine_e2e.py and test_server.py.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys

import pytest

import nanovllm
from nanovllm.config import OPTION_CHOICES, Config
from nanovllm.entrypoints import cli
from nanovllm.entrypoints.engine_args import NOT_FLAGS

ENTRYPOINTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nanovllm", "entrypoints")


class FakeLLM:
    """Records what the CLI builds; every prompt 'generates' two tokens and ends at the token limit."""
    calls: list[dict] = []
    tokenizer = None

    def __init__(self, model: str, **kwargs):
        FakeLLM.calls.append({"model": model, "kwargs": kwargs})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def generate(self, prompts, params, use_tqdm=True):
        FakeLLM.calls[-1].update(prompts=prompts, params=params)
        return [{"text": "", "token_ids": [7, 8], "finish_reason": "length"} for _ in prompts]


@pytest.fixture
def fake_llm(monkeypatch):
    FakeLLM.calls = []
    monkeypatch.setattr("nanovllm.LLM", FakeLLM)
    return FakeLLM.calls


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


TINY = ["--device", "cpu", "--max-model-len", "128", "--kvcache-block-size", "4"]


# ------------------------------------------------------------------------------------------------ prompts

@pytest.mark.parametrize("argv, message", [
    (["generate", ""], "prompt #0 is empty"),
    (["generate", "hi", ""], "prompt #1 is empty"),
    (["generate", "--prompt-ids", ""], "--prompt-ids '' has no token ids"),
    (["generate", "--prompt-ids", " , "], "has no token ids"),
    (["generate", "--prompt-ids", "a,b"], "--prompt-ids: 'a' is not an integer"),
    (["generate", "--prompt-ids", "5,,6"], "--prompt-ids: '' is not an integer"),
    (["generate", "--prompt-ids", "5,-1"], "--prompt-ids: -1 is negative"),
    (["generate", "--prompt-ids", "5,512"], "token id 512 of prompt #0 is outside the vocabulary [0, 512)"),
    (["generate", "--prompt-ids", ",".join(["5"] * 129)], "more than --max-model-len=128"),
    (["generate", "x\udcff"], "prompt #0 is not valid UTF-8"),  # argv bytes that are not UTF-8
    (["generate", "--prompt-ids", "5", "--min-tokens", "9", "--max-tokens", "4"], "--min-tokens=9"),
    (["generate", "--prompt-ids", "5", "--min-p", "2"], "--min-p=2.0"),
])
def test_bad_prompts_and_options_are_refused_before_the_model_loads(capsys, fake_llm, qwen3_dir, argv, message):
    code, _, err = run(capsys, *argv, "--model", qwen3_dir, *TINY)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert fake_llm == [], "the model was loaded before the prompt was checked"


def test_a_bad_engine_option_is_refused_before_the_model_loads(capsys, fake_llm, qwen3_dir):
    code, _, err = run(capsys, "generate", "--prompt-ids", "5", "--model", qwen3_dir, "--device", "cpu",
                       "--kvcache-block-size", "3")
    assert code == 2 and "--kvcache-block-size=3 must be a power of two" in err and fake_llm == []


def test_errors_name_the_flags_a_user_typed():
    parser = cli.argparse.ArgumentParser()
    gen = cli.add_generate_parser(parser.add_subparsers())
    message = ("gpu_memory_budget_gib=0 must be > 0; raise max_num_seqs or kv_cache_memory_bytes; device='tpu' is "
               "not a device; seed=x; min_p=2.0; model='/tmp/max_model_len' is not a directory")
    assert cli.flags_for_fields(message, gen) == (
        "--gpu-memory-gib=0 must be > 0; raise --max-num-seqs or --kv-cache-memory-bytes; --device='tpu' is not a "
        "device; --seed=x; --min-p=2.0; --model='/tmp/max_model_len' is not a directory")


def test_a_directory_where_a_prompt_goes_is_refused(capsys, fake_llm, qwen3_dir):
    """`nanovllm generate MODEL "prompt"` (the model where a prompt goes) would answer the path as a prompt."""
    code, _, err = run(capsys, "generate", qwen3_dir, "hello", *TINY)
    assert code == 2 and fake_llm == []
    assert err == f"error: prompt #0 {qwen3_dir!r} is a directory; pass a model with --model {qwen3_dir}\n"
    code, _, _ = run(capsys, "generate", "--model", qwen3_dir, "hello", *TINY)
    assert code == 0 and fake_llm[0]["model"] == qwen3_dir


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"nanovllm {nanovllm.__version__}\n"


@pytest.mark.parametrize("command, defaults", [
    ("generate", ["--max-tokens MAX_TOKENS  tokens per answer at most (default: 64)", "(default: 0.9)"]),
    ("chat", ["tokens per answer at most (default: 256)"]),
    ("serve", ["TCP port to listen on (default: 8000)", "(default: 127.0.0.1)"]),
])
def test_help_shows_the_defaults(capsys, monkeypatch, command, defaults):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in defaults:
        assert " ".join(default.split()) in text, default
    assert "(default: None)" not in text and "(default: False)" not in text


def test_sampling_flags_reach_sampling_params_and_a_cut_answer_says_so(capsys, fake_llm, qwen3_dir):
    code, out, _ = run(capsys, "generate", "--prompt-ids", "5,17,42", "--model", qwen3_dir, *TINY,
                       "--stop", "a", "--stop", "bc", "--min-p", "0.25", "--min-tokens", "2", "--max-tokens", "6")
    assert code == 0
    [call] = fake_llm
    params = call["params"]
    assert (params.stop, params.min_p, params.min_tokens, params.max_tokens) == (["a", "bc"], 0.25, 2, 6)
    assert call["prompts"] == [[5, 17, 42]]
    assert out.splitlines()[-1] == "[finished: length]"


def test_the_demo_question_is_the_default_prompt(capsys, fake_llm, smollm2_dir):
    code, out, _ = run(capsys, "generate", "--model", smollm2_dir, "--device", "cpu")
    assert code == 0 and repr(cli.DEMO_PROMPT) in out
    [prompt_ids] = fake_llm[0]["prompts"]
    assert len(prompt_ids) > 8  # through the chat template: more than the question's own tokens


# ------------------------------------------------------------------------------------------------ the CPU footprint

def test_generate_on_the_cpu_sizes_the_caches_for_its_prompts(capsys, fake_llm, qwen3_dir):
    """A prompt of 3 tokens and 6 new ones in 4-token blocks: ceil(9 / 4) blocks, plus one for the extra token that
    asynchronous scheduling may compute; every prompt fits at once, so no host pool."""
    run(capsys, "generate", "--prompt-ids", "5,6,7", "--model", qwen3_dir, *TINY, "--max-tokens", "6")
    assert fake_llm[-1]["kwargs"]["num_kvcache_blocks"] == 3 + 1
    assert fake_llm[-1]["kwargs"]["swap_space"] == 0
    cli_args = ["generate", "--model", qwen3_dir, *TINY, "--max-tokens", "6"]
    # a prompt that runs into max_model_len needs no more than max_model_len tokens of KV
    run(capsys, *cli_args, "--prompt-ids", ",".join(["5"] * 126))
    assert fake_llm[-1]["kwargs"]["num_kvcache_blocks"] == 128 // 4 + 1


def test_cache_options_the_user_set_are_kept(capsys, fake_llm, qwen3_dir):
    run(capsys, "generate", "--prompt-ids", "5", "--model", qwen3_dir, *TINY, "--num-kvcache-blocks", "99",
        "--preemption-mode", "swap")
    kwargs = fake_llm[-1]["kwargs"]
    assert kwargs["num_kvcache_blocks"] == 99 and "swap_space" not in kwargs


# ------------------------------------------------------------------------------------------------ engine flags

def parse(*argv):
    parser = cli.argparse.ArgumentParser()
    cli.add_generate_parser(parser.add_subparsers())
    return parser.parse_args(["generate", *argv])


def test_every_config_option_has_a_flag_and_config_keeps_its_defaults():
    names = [f.name for f in dataclasses.fields(Config) if f.init and f.name not in NOT_FLAGS]
    assert len(names) >= 20
    assert cli.engine_kwargs(parse()) == {}  # nothing set: Config alone decides the defaults
    argv = []
    for name in names:
        flag = f"--{name.replace('_', '-')}"
        default = next(f.default for f in dataclasses.fields(Config) if f.name == name)
        if isinstance(default, bool) or name == "async_scheduling":
            argv.append(flag)
        elif name in OPTION_CHOICES:
            argv += [flag, OPTION_CHOICES[name][-1]]
        else:
            argv += [flag, "3"]
    assert set(cli.engine_kwargs(parse(*argv))) == set(names)


def test_flags_keep_their_types_choices_and_old_spellings():
    kwargs = cli.engine_kwargs(parse("--swap-space", "0.5", "-tp", "2", "--no-prefix-caching", "--dtype", "float16",
                                     "--no-async-scheduling", "--max-model-len", "64"))
    assert kwargs == {"swap_space": 0.5, "tensor_parallel_size": 2, "enable_prefix_caching": False,
                      "dtype": "float16", "async_scheduling": False, "max_model_len": 64}
    with pytest.raises(SystemExit):
        parse("--preemption-mode", "sometimes")


def test_the_budget_flag_is_spelled_as_in_the_other_tools_and_keeps_its_old_name():
    assert cli.engine_kwargs(parse("--gpu-memory-gib", "8")) == {"gpu_memory_budget_gib": 8.0}
    assert cli.engine_kwargs(parse("--gpu-memory-budget-gib", "7.5")) == {"gpu_memory_budget_gib": 7.5}


# ------------------------------------------------------------------------------------------------ serve

@pytest.mark.parametrize("argv, name", [([], "qwen3"), (["--served-model-name", "tiny"], "tiny")])
def test_the_served_model_name_defaults_to_the_directory_name(monkeypatch, qwen3_dir, argv, name):
    import nanovllm.entrypoints.server as server
    seen = []
    monkeypatch.setattr(server, "serve", lambda args, model, served_name, kwargs: seen.append(served_name) or 0)
    assert cli.main(["serve", qwen3_dir + os.sep, *argv]) == 0
    assert seen == [name]


# ------------------------------------------------------------------------------------------------ the house

@pytest.mark.subprocess
def test_the_cli_and_the_server_import_no_cycle():
    """The CLI imports the server only when `serve` runs (FastAPI stays optional); the server never imports the
    CLI."""
    code = ("import sys, nanovllm.entrypoints.cli; assert 'nanovllm.entrypoints.server' not in sys.modules; "
            "assert 'fastapi' not in sys.modules; del sys.modules['nanovllm.entrypoints.cli']; "
            "import nanovllm.entrypoints.server; assert 'nanovllm.entrypoints.cli' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_bad_model_or_prompt_is_refused_before_torch_imports(tmp_path):
    """`generate` checks its prompts, options and model directory before it imports torch (1.5 CPU-s): a typo is
    answered at once."""
    code = ("import sys; from nanovllm.entrypoints import cli; "
            "codes = [cli.main(['generate', 'hi', '--model', sys.argv[1]]), cli.main(['generate', '', '--model', "
            "sys.argv[1]])]; print(codes, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "missing")], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["[2,", "2]", "False"], done.stdout + done.stderr
    assert "is not a directory" in done.stderr and "prompt #0 is empty" in done.stderr, done.stderr


def test_entrypoint_files_and_functions_stay_small():
    for root, _, files in os.walk(ENTRYPOINTS):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            source = open(path).read()
            assert source.count("\n") <= 400, f"{path} has {source.count(chr(10))} lines"
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    num_lines = node.end_lineno - node.lineno + 1
                    assert num_lines <= 60, f"{path}: {node.name} has {num_lines} lines"
