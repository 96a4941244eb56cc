"""setup.py's reading of TORCH_CUDA_ARCH_LIST (the forms torch accepts) into -gencode flags."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def setup_ns():
    """setup.py's definitions, without the build and setup() call at its end."""
    src = open(os.path.join(ROOT, "setup.py")).read()
    body = src[:src.index("ext_modules, cmdclass = _extensions()")]
    ns = {"__file__": os.path.join(ROOT, "setup.py"), "__name__": "fp8ops_setup_test"}
    exec(compile(body, "setup.py", "exec"), ns)
    return ns


@pytest.mark.parametrize("text, sass, ptx", [
    ("8.9;9.0a;9.0+PTX", ["89", "90a"], ["90"]),
    ("8.0 8.6 9.0+PTX", ["80", "86", "90"], ["90"]),
    ("8.9,9.0", ["89", "90"], []),
    ("  9.0a ;; 10.0  12.0+PTX ", ["90a", "100", "120"], ["120"]),
])
def test_arch_list_forms(setup_ns, text, sass, ptx):
    assert setup_ns["parse_arch_list"](text) == (sass, ptx)


def test_ptx_becomes_a_compute_target(setup_ns):
    flags = setup_ns["_cast_gencodes"](*setup_ns["parse_arch_list"]("8.9 9.0+PTX"))
    assert "-gencode=arch=compute_90,code=compute_90" in flags
    assert "-gencode=arch=compute_89,code=sm_89" in flags


def test_unreadable_entry_is_named(setup_ns):
    with pytest.raises(ValueError, match="Hopper"):
        setup_ns["parse_arch_list"]("8.9;Hopper")


def test_cpu_extension_sources_and_switch(setup_ns, monkeypatch):
    from torch.utils import cpp_extension
    monkeypatch.chdir(ROOT)
    ext = setup_ns["_cpu_extension"](cpp_extension)
    assert ext.name == "fp8ops._cpu"
    names = sorted(os.path.basename(s) for s in ext.sources)
    assert {"bindings_cpu.cpp", "stochastic_cpu.cpp", "mx_cpu.cpp", "blockwise_cpu.cpp"} <= set(names)
    assert not any(n.endswith(".cu") for n in names)
    monkeypatch.setenv("FP8OPS_SKIP_CPU_BUILD", "1")
    assert setup_ns["_cpu_extension"](cpp_extension) is None


def test_gemm_retargeting_leaves_a_cpp_only_build_file_alone(setup_ns, tmp_path):
    ninja = tmp_path / "build.ninja"
    text = "cflags = -O3\nbuild a.o: compile a.cpp\n"
    ninja.write_text(text)
    setup_ns["_retarget_gemm_objects"](str(ninja))
    assert ninja.read_text() == text
