"""tools/sass_loops.py's SASS reading (no GPU, no cuobjdump): instructions, predicates, loops and the out-of-line
blocks after the first unconditional EXIT that are not loops."""

from tools.sass_loops import loops, opcode, parse_sass

SASS = """
        Function : gemv_s8w
        /*0000*/                   MOV R1, c[0x0][0x28] ;             /* 0x00000a0000017a02 */
                                                                      /* 0x000fe40000000f00 */
        /*0010*/                   ISETP.GE.AND P0, PT, R9, R36, PT ; /* 0x000000240900720c */
        /*0020*/               @P0 EXIT ;                             /* 0x000000000000094d */
        /*0030*/                   LDG.E.128.CONSTANT R12, desc[UR8][R4.64] ; /* 0x0 */
        /*0040*/                   IDP.4A.S8.S8 R8, R33, R28, RZ ;    /* 0x0 */
        /*0050*/                   BRA.DIV UR5, 0xa0 ;                /* 0x0 */
        /*0060*/                   SHFL.BFLY PT, R30, R50, 0x1, 0x1f ; /* 0x0 */
        /*0070*/              @!P1 BRA 0x30 ;                         /* 0x0 */
        /*0080*/                   EXIT ;                             /* 0x0 */
        /*0090*/                   BRA 0x40 ;                         /* 0x0 */
        /*00a0*/                   BRA 0xa0;                          /* 0x0 */
"""


def test_parse_sass_keeps_predicates_and_addresses():
    instrs = parse_sass(SASS)
    assert [a for a, _ in instrs] == list(range(0, 0xb0, 0x10))
    assert instrs[2] == (0x20, "@P0 EXIT") and instrs[7] == (0x70, "@!P1 BRA 0x30")
    assert opcode("@!P1 LDG.E.128.CONSTANT R12, desc[UR8][R4.64]") == "LDG" and opcode("IDP.4A.S8.S8 R8") == "IDP"


def test_loops_are_back_edges_before_the_first_unconditional_exit():
    found = loops(parse_sass(SASS))
    # 0x30..0x70: LDG, IDP, BRA.DIV, SHFL, BRA; the branches after EXIT (0x90 into the body, 0xa0 to itself) are not
    # loops, and a predicated EXIT does not end the body
    assert found == [{"start": "0x30", "end": "0x70", "instructions": 5,
                      "opcodes": {"BRA": 2, "LDG": 1, "IDP": 1, "SHFL": 1}}]
