"""moeref.explain (`moeref explain SCHEME`): the walk's numbers against independent oracles, its
notes, the side-by-side rendering, and bad input."""
from __future__ import annotations

import numpy as np
import pytest

import nvfp4_oracles as orc
from moeref.explain import example_input, explain, explain_steps, explain_text
from moeref.quant import SCHEMES

pytest.importorskip("rich")


def test_nvfp4_walk_matches_the_oracles():
    x = example_input("nvfp4")
    steps = explain_steps("nvfp4", presets=["nvfp4_te", "nvfp4_flashinfer"])
    te, fi = steps["runs"]
    assert (te["preset"], fi["preset"]) == ("nvfp4_te", "nvfp4_flashinfer")
    codes, scales, amax = orc.te_nvfp4_ref(x)
    assert [b["scale code"] for b in te["blocks"]] == [f"0x{int(c):02x}" for c in scales[0]]
    assert [e["code"] for e in te["elements"]] == [f"0x{int(c):x}" for c in codes[0]]
    values, fscales = orc.flashinfer_ref_fp4_quant(x, orc.flashinfer_global_scale(x))
    assert [float(b["scale"]) for b in fi["blocks"]] == fscales[0].tolist()
    assert [float(e["value"]) for e in fi["elements"]] == values[0].tolist()
    # block amax and the global step, read independently from the input
    assert [float(b["amax"]) for b in te["blocks"]] == [6.0, 1.125]
    assert te["global"][0] == ("stored global scale", "6 (amax)")
    assert fi["global"][0] == ("stored global scale", "448 (encode_scale)")
    # dequantized = value * decode multiplier; error = dequantized - x (6 significant digits)
    for e, b in zip(fi["elements"][16:], [fi["blocks"][1]] * 16):
        deq = float(e["value"]) * float(b["decode multiplier"])
        assert float(e["dequantized"]) == pytest.approx(deq, rel=1e-5)
        assert float(e["error"]) == pytest.approx(float(e["dequantized"]) - float(e["x"]), abs=1e-5)


def test_notes_flag_ties_saturation_negative_zero_and_differences():
    x = example_input("nvfp4")
    te, fi = explain_steps("nvfp4", presets=["nvfp4_te", "nvfp4_flashinfer"])["runs"]
    assert x[0, 1] == 2.5 and "tie" in te["elements"][1]["note"]          # 2.5 -> 2 (even)
    assert x[0, 8] == np.float32(-0.1) and te["elements"][8]["note"] == "-0"
    # FlashInfer's scale 80: 1.125 * 448 / 80 = 6.3 > 6
    assert "saturated" in fi["elements"][16]["note"] and "saturated" not in te["elements"][16]["note"]
    differ = [i for i, (a, b) in enumerate(zip(te["elements"], fi["elements"])) if a["code"] != b["code"]]
    assert differ and all("differs" in te["elements"][i]["note"] for i in differ)
    assert all("differs" not in e["note"] for i, e in enumerate(te["elements"]) if i not in differ)


def test_text_rendering_side_by_side():
    text = explain_text("nvfp4", presets=["nvfp4_te", "nvfp4_flashinfer"])
    for part in ("Step 1. Global", "Step 2. Block amax", "Step 3. Elements", "0x6b", "0x6a",
                 "(A) nvfp4_te", "(B) nvfp4_flashinfer", "differs"):
        assert part in text
    single = explain_text("mxfp4")
    assert "Step 1" not in single and "Step 2. Block amax" in single and "(A)" not in single


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_every_scheme_walks(name):
    steps = explain_steps(name)
    x = example_input(name)
    run = steps["runs"][0]
    assert len(run["elements"]) == x.size
    assert [float(e["x"]) for e in run["elements"]] == pytest.approx(x.ravel().tolist(), rel=1e-5)


def test_seeds_and_custom_input():
    a, b = example_input("nvfp4", seed=1), example_input("nvfp4", seed=2)
    assert not np.array_equal(a, b) and np.array_equal(a, example_input("nvfp4", seed=1))
    assert explain_text("nvfp4", seed=1) == explain_text("nvfp4", seed=1)
    steps = explain_steps("nvfp4", x=[6.0, 2.5, -5.0])
    assert steps["shape"] == (1, 3)
    assert [e["code"] for e in steps["runs"][0]["elements"]] == ["0x7", "0x4", "0xe"]
    assert example_input("nvfp4_weight").shape == (2, 16)


def test_bad_input():
    with pytest.raises(ValueError, match="unknown scheme 'nvfp5'.*nvfp4"):
        explain("nvfp5")
    with pytest.raises(ValueError, match="no presets"):
        explain_steps("w4a8_cutlass", presets=["te"])
    with pytest.raises(ValueError, match="unknown preset"):
        explain_steps("mxfp4", presets=["nope"])
    with pytest.raises(ValueError, match="1..64 elements"):
        explain_steps("nvfp4", x=np.ones(65, np.float32))
    with pytest.raises(TypeError):
        explain_steps("nvfp4", x=np.ones(4, np.int32))


def test_cli_explain(capsys):
    from moeref.cli import main

    assert main(["explain", "nvfp4", "--preset", "nvfp4_te", "--preset", "nvfp4_flashinfer"]) == 0
    out = capsys.readouterr().out
    assert "0x6b" in out and "0x6a" in out
