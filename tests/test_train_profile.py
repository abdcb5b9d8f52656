"""bench/train_profile.py's attribution of compiled kernels to the FX nodes they compute (the GPU profile itself
runs on the GPU machine)."""
from bench.train_profile import kernel_origins

MODULE = '''
# kernel path: /tmp/torchinductor_x/ab/cab.py
# Topologically Sorted Source Nodes: [softmax, q], Original ATen: [aten._softmax, aten.mul]
# Source node to ATen node mapping:
#   softmax => amax, exp
triton_per_fused__softmax_mul_0 = async_compile.triton('triton_per_fused__softmax_mul_0', """
@triton.jit
def triton_per_fused__softmax_mul_0(in_ptr0, out_ptr0, xnumel, r0_numel):
    pass
""")

class Runner:
    def call(self, args):
        buf0 = empty_strided_cuda((64, 51), (51, 1), torch.float32)
        # Topologically Sorted Source Nodes: [logits_a], Original ATen: [aten.mm]
        extern_kernels.mm(primals_1, primals_2, out=buf0)
        # Topologically Sorted Source Nodes: [softmax, q], Original ATen: [aten._softmax, aten.mul]
        stream0 = get_raw_stream(0)
        triton_per_fused__softmax_mul_0.run(buf0, buf1, 64, 51, stream=stream0)
        triton_poi_fused_unattributed_1.run(buf1, 64, stream=stream0)
'''


def test_kernels_are_named_with_the_nodes_they_compute(tmp_path):
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "cab.py").write_text(MODULE)
    (tmp_path / "cd.py").write_text(MODULE.replace("[softmax, q]", "[mul_23, sum_5]"))    # another graph, same name
    origins = kernel_origins(str(tmp_path))
    assert origins["triton_per_fused__softmax_mul_0"] == {"softmax, q", "mul_23, sum_5"}
    assert origins["mm"] == {"logits_a"}
    assert "triton_poi_fused_unattributed_1" not in origins
