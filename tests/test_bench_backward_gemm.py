"""bench/bench_backward_gemm.py's table (its timing needs a GPU): speed-ups against the promoted
GEMM, errors kept in their cells, a geomean over the shapes that ran."""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))
import bench_backward_gemm as bb  # noqa: E402


def test_table_ratios_errors_and_geomean():
    rows = [((256, 128, 64), "dgrad", {"CUTLASS promoted": 100.0, "fp8ops fast": 125.0,
                                        "_scaled_mm": 80.0, "_scaled_mm fast": 150.0,
                                        "bf16 mm": 50.0}),
            ((256, 128, 64), "wgrad", {"CUTLASS promoted": 200.0, "fp8ops fast": 200.0,
                                        "_scaled_mm": "RuntimeError: no kernel",
                                        "_scaled_mm fast": 400.0, "bf16 mm": 100.0})]
    table = bb.render(rows, {"device": "test"}, argparse.Namespace(iters=3))
    lines = table.splitlines()
    dgrad = next(line for line in lines if "| dgrad |" in line)
    assert dgrad.endswith("| 1.25 | 0.80 | 1.50 | 0.50 |")
    wgrad = next(line for line in lines if "| wgrad |" in line)
    assert "RuntimeError: no kernel" in wgrad and wgrad.endswith("| 1.00 | - | 2.00 | 0.50 |")
    geo = lines[-1]
    assert "geomean" in geo and geo.endswith("| 1.12 | 0.80 | 1.73 | 0.50 |")


def test_candidate_env_is_set_around_the_candidate_and_then_restored(monkeypatch):
    key = "FP8OPS_SM90_PROMOTED_GEMM"
    monkeypatch.delenv(key, raising=False)
    with bb.candidate_env("CUTLASS promoted"):
        assert os.environ[key] == "cutlass"
    assert key not in os.environ
    monkeypatch.setenv(key, "cublaslt")  # a user's own setting outlives the benchmark
    with bb.candidate_env("CUTLASS promoted"):
        assert os.environ[key] == "cutlass"
    assert os.environ[key] == "cublaslt"
    with bb.candidate_env("_scaled_mm"):  # the others run in the environment as it is
        assert os.environ[key] == "cublaslt"
