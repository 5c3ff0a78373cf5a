"""bench/probes/conv_tma_race.py's list of configs: the offered ones, then the guard's left-outs as controls."""

from __future__ import annotations

from bench.probes import conv_tma_race as probe
from kernels import conv_tma
from kernels.conv import m_bucket


def test_controls_are_the_racy_tiles_at_the_stages_the_guard_leaves_out():
    for N, C, H, W, OC, win, _ in probe.LAYERS:
        pairs = probe.candidates_and_controls(N * H * W, OC, C, H, W, win)
        offered = [c for c, guarded in pairs if not guarded]
        controls = [c for c, guarded in pairs if guarded]
        assert offered == conv_tma.cuda_configs(m_bucket(N * H * W), OC, C, H, W, (win, win), 2)
        assert controls and not set(controls) & set(offered)
        for c in controls:
            bm = c["IMG"] * c["BH"] * c["BW"]
            assert conv_tma.racy_stages(bm, c["BLOCK_N"], c["BLOCK_K"], 2) and c.num_stages in (3, 4)
            assert conv_tma.shared_memory_bytes(c, 2) <= conv_tma.HOPPER_SHARED_MEMORY
            same_tile = [o for o in offered if o.kwargs == c.kwargs and o.num_warps == c.num_warps]
            assert [o.num_stages for o in same_tile] == [2]


def test_a_wrong_element_names_its_program():
    assert probe.box_of([5, 70, 3, 2], {"IMG": 2, "BH": 8, "BW": 8, "BLOCK_N": 64}, 2) == "box n2 h0 w0, cols 1"
