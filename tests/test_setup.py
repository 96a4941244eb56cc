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
