"""bench/train_profile.py's attribution of compiled kernels to the FX nodes they compute (the GPU profile itself
runs on the GPU machine)."""
from bench.train_profile import kernel_origins, kernel_sizes, kind, phases, replay_timeline

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


KERNELS = """
@triton_heuristics.pointwise(
    size_hints={'x': 33554432}, tile_hint=TileHint.DEFAULT,
    inductor_meta={'grid_type': 'SequentialComboKernelGrid', 'combo_grid_meta': {'num_kernels': 2, 'min_blocks': 0,
    'default_config': None, 'no_x_dim_0': False, 'xnumel_0': 2048, 'no_x_dim_1': False, 'xnumel_1': 33554432},
    'kernel_name': 'triton_poi_fused_60', 'mutated_arg_names': []}
)
@triton.jit
def triton_poi_fused_60(in_ptr0, out_ptr0, XBLOCK : tl.constexpr):
    pass

@triton_heuristics.reduction(
    size_hints={'x': 8, 'r0_': 256},
    inductor_meta={'kernel_name': 'triton_red_fused_sum_37', 'mutated_arg_names': []}
)
@triton.jit
def triton_red_fused_sum_37(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr, R0_BLOCK : tl.constexpr):
    pass
"""


def test_kernel_sizes_give_each_combo_parts_elements(tmp_path):
    """What a launch covers, from kernel modules as inductor wrote them (the H100's 8-run lockstep iteration,
    bench/README.md 2026-12-06 · 35ee78b): a combo kernel's parts, a reduction's rows and their length; a name two
    graphs gave different kernels keeps both."""
    (tmp_path / "a.py").write_text(KERNELS)
    (tmp_path / "b.py").write_text(KERNELS.replace("'x': 8, 'r0_': 256", "'x': 16, 'r0_': 256"))
    sizes = kernel_sizes(str(tmp_path))
    assert sizes["triton_poi_fused_60"] == "2 048 + 33 554 432"
    assert sizes["triton_red_fused_sum_37"] == "x 16 × r0 256 / x 8 × r0 256"
    (tmp_path / "empty").mkdir()
    assert kernel_sizes(str(tmp_path / "empty")) == {}


def test_kernel_kinds_name_what_a_fix_would_target():
    """The finer kinds of the step's own stream, from kernel names as the H200 trace had them (bench/README.md,
    entry 8833b0a)."""
    want = {"c51_fwd": "fused C51", "c51_bwd": "fused C51",
            "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "split-K reduction",
            "nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_bias_TNN": "GEMM",
            "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": "attention",
            "triton_for_fused_3": "optimizer / foreach",
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<LpNormFunctor>": "optimizer / foreach",
            "triton_red_fused_sum_52": "bias-gradient sum", "triton_per_fused_sum_46": "bias-gradient sum",
            "triton_poi_fused__to_copy_21": "weight cast / pad",
            "triton_poi_fused__to_copy_constant_pad_nd_16": "weight cast / pad",
            "triton_poi_fused_constant_pad_nd_view_7": "weight cast / pad",
            "triton_poi_fused_2": "combo",
            "triton_per_fused__softmax__to_copy_exp_mul_prepare_softmax_online_slice_sub_sum_": "inductor element-wise",
            "triton_red_fused_sum_threshold_backward_view_10": "inductor element-wise",
            "void at::native::_scatter_gather_elementwise_kernel<128, 8>": "aten",
            "Memset (Device)": "aten", "something else": "other"}
    for name, prefix in want.items():
        assert kind(name).startswith(prefix), (name, kind(name))


def test_phases_split_the_own_stream_at_launch_pauses():
    """Kernels (start µs, µs, name) out of order, one overlapping its predecessor; pauses of 150 and 400 µs split
    them, a gap of 60 µs does not."""
    ks = [(0.0, 3.0, "rand"), (5.0, 14.0, "sample_a"), (79.0, 2.0, "sample_b"),          # gaps 2, 60: one phase
          (231.0, 10.0, "enc_fwd"), (236.0, 4.0, "overlapping"),                         # pause 150
          (645.0, 50.0, "bwd_loop")]                                                     # pause 404 after 241
    got = phases(list(reversed(ks)))
    assert got == [(3, 19.0, "rand"), (2, 14.0, "enc_fwd"), (1, 50.0, "bwd_loop")]
    assert phases(ks, gap_us=1000.0) == [(6, 83.0, "rand")]
    assert phases([]) == []


def test_replay_timeline_counts_busy_time_once_and_finds_the_waits(tmp_path, capsys):
    """One replay of three (the last): each stream's busy time is the union of its kernels' intervals (overlapping
    launches count once), and the update stream's idle gaps are where it waited, with the kernels around them."""
    from types import SimpleNamespace as NS

    def ev(start, end, stream, name):
        return NS(time_range=NS(start=start, end=end), device_resource_id=stream, name=name)
    kernels = []
    for r in range(3):
        o = 1000.0 * r
        kernels += [ev(o, o + 10, 7, "a"), ev(o + 8, o + 30, 7, "b"), ev(o + 5, o + 50, 25, "targets"),
                    ev(o + 60, o + 70, 7, "loss"), ev(o + 65, o + 75, 7, "d"), ev(o + 90, o + 95, 7, "e")]
    trace = tmp_path / "replay.tsv"
    replay_timeline(kernels, str(trace))
    out = capsys.readouterr().out
    assert "| 7 | 5 | 50 | 0 | 95 |" in out                     # 0–30, 60–75 and 90–95 busy, overlaps once
    assert "| 25 | 1 | 45 | 5 | 50 |" in out
    assert "(7) idle 45 µs in 2 gaps" in out and "| 30.0 | 30 | b | loss | 25: targets |" in out
    assert "| 15.0 | 75 | d | e | – |" in out                   # nothing else ended in it: a launch wait
    rows = trace.read_text().splitlines()
    assert rows[0] == "start_us\tend_us\tstream\tkernel" and len(rows) == 7 and rows[1].startswith("0.0\t10.0\t7\ta")
