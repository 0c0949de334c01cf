"""fsdp_compile.debug.wrapper_check on small wrappers in Inductor's format (the GPU-codegen tier runs it
on real generated ones)."""

from __future__ import annotations

import textwrap

from fsdp_compile.debug.wrapper_check import check_wrapper

KERNELS = '''
@triton.jit
def triton_poi_fused_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    pass

@triton.jit
def triton_poi_fused_1(in_out_ptr0, in_ptr0, xnumel, XBLOCK : tl.constexpr):
    pass
'''

REGION = '''
def partitioned_fw_subgraph_0_0(args):
    a, b = args
    args.clear()
    with torch.cuda._DeviceGuard(0):
        sub_buf0 = empty_strided_cuda((8, 8), (8, 1), torch.float32)
        extern_kernels.mm(a, b, out=sub_buf0)
        triton_poi_fused_0.run(sub_buf0, a, 64, stream=raw_stream0)
        extern_kernels.mm(a, a, out=sub_buf0)
    return (sub_buf0, )
'''


def wrapper(body: str) -> str:
    call = "class Runner:\n    def call(self, args):\n        primals_1, primals_2 = args\n" + textwrap.indent(textwrap.dedent(body), " " * 8)
    return KERNELS + REGION + "\nasync_compile.wait(globals())\n" + call + "\n\nrunner = Runner(partitions=[])\n"


GOOD = """
buf0 = empty_strided_cuda((64, ), (1, ), torch.float32)
triton_poi_fused_0.run(primals_1, buf0, 64, stream=raw_stream0)
buf1 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf0, 8, '0')
buf2 = empty_strided_cuda((8, 8), (8, 1), torch.float32)
extern_kernels.mm(primals_2, primals_2, out=buf2)
partitioned_fw_subgraph_0_0_args = [buf2, primals_2]
buf3 = partitioned_fw_subgraph_0_0(partitioned_fw_subgraph_0_0_args)
torch.ops._c10d_functional.wait_tensor.default(buf1)
assert_size_stride(buf1, (512, ), (1, ), 'x')
triton_poi_fused_1.run(buf2, buf1, 64, stream=raw_stream0)
return (buf2, buf1, )
"""


def test_a_correct_wrapper_passes_and_the_overlap_is_counted():
    report = check_wrapper(wrapper(GOOD))
    assert report.ok, report.problems
    [c] = report.collectives
    assert (c.op, c.output, c.function) == ("all_gather_into_tensor", "buf1", "call")
    # one mm in call, the region's two mms and its kernel: 4 launches, 3 matmuls
    assert (c.kernels_between, c.matmuls_between) == (4, 3)


def test_output_read_before_its_wait():
    bad = GOOD.replace("extern_kernels.mm(primals_2, primals_2, out=buf2)", "extern_kernels.mm(buf1, primals_2, out=buf2)")
    [problem] = check_wrapper(wrapper(bad)).problems
    assert "all_gather_into_tensor output buf1" in problem and "used before its wait" in problem


def test_input_written_or_reused_before_the_wait():
    # the all-gather's input is a Triton kernel's in_out pointer after the collective
    written = GOOD.replace("extern_kernels.mm(primals_2, primals_2, out=buf2)", "triton_poi_fused_1.run(buf0, primals_2, 64, stream=raw_stream0)")
    [problem] = check_wrapper(wrapper(written)).problems
    assert "input buf0" in problem and "written before the wait" in problem
    # ... and read as in_ptr0 is fine
    read = GOOD.replace("extern_kernels.mm(primals_2, primals_2, out=buf2)", "triton_poi_fused_0.run(buf0, buf2, 64, stream=raw_stream0)")
    assert check_wrapper(wrapper(read)).ok
    # a view of the input passed as out=
    view = GOOD.replace("buf2 = empty_strided_cuda((8, 8), (8, 1), torch.float32)",
                        "buf9 = reinterpret_tensor(buf0, (8, 8), (8, 1), 0)  # alias\nbuf2 = empty_strided_cuda((8, 8), (8, 1), torch.float32)")
    view = view.replace("out=buf2)", "out=buf9)", 1)
    assert any("input buf0" in p and "written" in p for p in check_wrapper(wrapper(view)).problems)
    # Inductor handing the input's memory to another buffer
    reused = GOOD.replace("buf2 = empty_strided_cuda((8, 8), (8, 1), torch.float32)",
                          "buf2 = reinterpret_tensor(buf0, (8, 8), (8, 1), 0); del buf0  # reuse")
    assert any("input buf0" in p and "reused before the wait" in p for p in check_wrapper(wrapper(reused)).problems)


def test_an_output_never_waited():
    bad = GOOD.replace("torch.ops._c10d_functional.wait_tensor.default(buf1)\n", "")
    problems = check_wrapper(wrapper(bad)).problems
    assert any("never waited" in p for p in problems)


def test_collectives_inside_a_region_are_checked_there():
    region = REGION.replace("        extern_kernels.mm(a, a, out=sub_buf0)\n",
                            "        sub_buf1 = torch.ops._c10d_functional.reduce_scatter_tensor.default(sub_buf0, 'sum', 8, '0')\n"
                            "        extern_kernels.mm(a, a, out=sub_buf0)\n")
    code = wrapper(GOOD).replace(REGION, region)
    report = check_wrapper(code)
    assert [(c.function, c.op) for c in report.collectives] == [
        ("partitioned_fw_subgraph_0_0", "reduce_scatter_tensor"), ("call", "all_gather_into_tensor")]
    # its input is then overwritten by the mm, and it is never waited
    assert any("input sub_buf0" in p and "written" in p for p in report.problems)
    assert any("sub_buf1 is never waited" in p for p in report.problems)
