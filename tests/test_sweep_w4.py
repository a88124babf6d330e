"""benchmarks/sweep_w4.py on the CPU, under Triton's interpreter with the GPU timing stubbed: every kernel the sweep
times runs its candidate plans correctly on a small shape, and the report turns the winners into a
W4_DECODE_TILES that quant_plans accepts. The GPU run itself is the lead's (the command is in the sweep's docstring).
"""
import pytest

pytest.importorskip("triton")

from interpreter_support import interpret  # noqa: E402

SWEEP_SCRIPT = """
import contextlib, io, json, sys
sys.path.insert(0, "BENCH_DIR")
import torch
import bench_quant_kernels as bqk
import sweep_w4
from nanovllm.kernels import quant_plans as qp

bqk.DEVICE = "cpu"
bqk.SHAPES = {"a": (40, 256), "b": (24, 512)}
bqk.L2_DEFEAT_BYTES = 1  # two copies
# a stub clock: wider column tiles are faster, the swapped dot a little faster still and the multi-row kernel a
# little slower, so the winners are known
bqk.graph_us = lambda fn, num_calls: (fn(0), fn(1), 1000.0 / fn.keywords["plan"].block_n
                                      - 0.5 * fn.keywords["plan"].swap_ab + 0.25 * fn.keywords["plan"].multi_row)[-1]
shapes = [sweep_w4.Shape.make(name) for name in bqk.SHAPES]
rows = []
current = {M: qp.w4_decode_tiles(M) for M in (1, 2, 4, 16)}
for shape in shapes:
    for M in current:
        x = torch.randn(M, shape.K).to(torch.bfloat16)
        ref = x.float() @ shape.w_ref.T
        rows.append(dict(sweep_w4.time_cell(shape, M, x, ref, current[M], 3000.0), current=True))
        for kernel, ms in sweep_w4.KERNEL_MS.items():
            if M not in ms:
                continue
            tiles = [t for t in sweep_w4.candidates(kernel, M) if t.num_warps == 4 and t.programs_per_sm == 4
                     and t.num_stages <= 2 and t.block_k == (64 if kernel == "dot_swapped" else 128)]
            for t in (tiles[0], tiles[-1]):
                rows.append(sweep_w4.time_cell(shape, M, x, ref, t, 3000.0))
out = io.StringIO()
with contextlib.redirect_stdout(out):
    sweep_w4.report(rows, list(bqk.SHAPES), current)
text = out.getvalue()
table = text[text.index("W4_DECODE_TILES = ("):]
namespace = {"DecodeTiles": qp.DecodeTiles}
exec(table, namespace)
qp.check_decode_tiles(namespace["W4_DECODE_TILES"])
print(json.dumps(dict(rows=rows, text=text, table=[t.__dict__ for t in namespace["W4_DECODE_TILES"]])))
"""


def test_the_sweep_times_every_kernel_and_prints_a_valid_table():
    from pathlib import Path
    bench_dir = Path(__file__).resolve().parents[1] / "benchmarks"
    res = interpret(SWEEP_SCRIPT.replace("BENCH_DIR", str(bench_dir)))
    rows = res["rows"]
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
    assert all(r["rel_err"] <= 2 ** -6 and r["us"] > 0 for r in rows)
    assert {(r["kernel"], r["M"]) for r in rows} == {("gemv", 1), ("gemv", 2), ("rows", 2), ("rows", 4),
                                                      ("rows", 16), ("dot", 4), ("dot", 16), ("dot_swapped", 4),
                                                      ("dot_swapped", 16)}
    # the stub makes the widest tile win: gemv's 128 columns at 1 and 2 rows (4 warps hold 256 only with 64-column
    # K steps, which the script does not pick; rows' 128 is slower), and at 4 and 16 rows the swapped dot's 256
    # (over the dot's 256 and rows' 128); equal neighbours merge into one range
    assert [(t["max_rows"], t["kernel"], t["block_n"]) for t in res["table"]] == [(2, "gemv", 128),
                                                                                  (16, "dot_swapped", 256)]
    assert "M=16  dot_swapped n256 k64 w4 p4 s2" in res["text"]
