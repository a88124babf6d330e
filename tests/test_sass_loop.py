"""benchmarks/sass_loop.py's reading of nvdisasm's output: the longest loop's instructions, by opcode (no GPU and
no compile here: the compile tests compile the same kernel)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from sass_loop import loop_opcodes  # noqa: E402

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/               @P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0030*/                   SHF.L.U32 R3, R4, 0x13, RZ ;
        /*0040*/                   LOP3.LUT R3, R3, 0x3f800000, R5, 0xec, !PT ;
        /*0050*/                   FFMA R6, R3, R7, R6 ;
        /*0060*/              @!P1 LDG.E.128 R8, desc[UR4][R10.64] ;
        /*0070*/                   FFMA R9, R3, R7, R9 ;
        /*0080*/               @P2 BRA `(.L_x_1) ;
.L_x_2:
        /*0090*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*00a0*/                   EXIT ;
"""


def test_the_longest_loop_is_counted_by_opcode_with_its_predicated_instructions():
    ops = loop_opcodes(SASS)
    assert ops == {"SHF": 1, "LOP3": 1, "FFMA": 2, "LDG": 1, "BRA": 1}  # not .L_x_0's loop, not the forward branch


def test_sass_without_a_loop_is_an_error():
    with pytest.raises(ValueError, match="no loop"):
        loop_opcodes("        /*0000*/                   EXIT ;\n")
