"""setup.py's reading of TORCH_CUDA_ARCH_LIST (the forms torch accepts) into -gencode flags, and
scripts/setup_env.sh's choice of what to build."""
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


def test_step_extension_sources_and_switch(setup_ns, monkeypatch):
    """fp8ops._step: C++ only (it calls the ops through the dispatcher), built with the CPU
    kernels and skipped with them."""
    from torch.utils import cpp_extension
    monkeypatch.chdir(ROOT)
    ext = setup_ns["_step_extension"](cpp_extension)
    assert ext.name == "fp8ops._step"
    assert [os.path.basename(s) for s in ext.sources] == [
        "linear_blockwise.cpp", "linear_mx.cpp", "linear_per_tensor.cpp"]
    monkeypatch.setenv("FP8OPS_SKIP_CPU_BUILD", "1")
    assert setup_ns["_step_extension"](cpp_extension) is None


def test_gemm_retargeting_leaves_a_cpp_only_build_file_alone(setup_ns, tmp_path):
    ninja = tmp_path / "build.ninja"
    text = "cflags = -O3\nbuild a.o: compile a.cpp\n"
    ninja.write_text(text)
    setup_ns["_retarget_gemm_objects"](str(ninja))
    assert ninja.read_text() == text


FAKE_BIN = {
    # records the build and makes the extensions the build switches ask for
    "pip": """#!/usr/bin/env bash
case " $* " in *" -e . "*)
  echo "build SKIP_CUDA=${FP8OPS_SKIP_CUDA_BUILD:-0}" >> "$FAKE_LOG"
  touch fp8ops/_cpu.fake.so
  [ "${FP8OPS_SKIP_CUDA_BUILD:-0}" = 1 ] || touch fp8ops/_C.fake.so ;;
esac
""",
    # torch.cuda.is_available() answers FAKE_GPU; `import fp8ops` succeeds
    "python": """#!/usr/bin/env bash
case "$*" in *cuda*) [ "$FAKE_GPU" = 1 ] ;; *) true ;; esac
""",
}


def _fake_checkout(root):
    """A checkout whose .venv has a pip that only records builds and a python that only answers
    whether a GPU is visible: setup_env.sh's build decisions, without a build."""
    (root / "scripts").mkdir()
    (root / "scripts" / "setup_env.sh").write_text(
        open(os.path.join(ROOT, "scripts", "setup_env.sh")).read())
    for name in ("setup.py", "pyproject.toml", "csrc/a.cu", "csrc/step/b.cpp"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    (root / "fp8ops").mkdir()
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    for name, text in FAKE_BIN.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


def test_setup_env_builds_cuda_for_the_demo_only_with_a_gpu(tmp_path):
    """The demo (--cuda-if-gpu) skips the CUDA extension without a GPU; the tests' call builds it
    after that, and its build serves the demo in turn; with a GPU the demo builds it too."""
    import subprocess
    _fake_checkout(tmp_path)
    log = tmp_path / "builds.log"

    def setup(*args, gpu=False):
        env = {**os.environ, "FAKE_LOG": str(log), "FAKE_GPU": str(int(gpu)),
               "CUDA_HOME": "/opt/cuda"}
        env.pop("FP8OPS_SKIP_CUDA_BUILD", None)
        proc = subprocess.run(["bash", str(tmp_path / "scripts" / "setup_env.sh"), *args],
                              capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        builds = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return builds

    demo, tests = ["--cuda-if-gpu"], []
    assert setup(*demo) == ["build SKIP_CUDA=1"]
    assert not (tmp_path / "fp8ops" / "_C.fake.so").exists()
    assert setup(*demo) == []
    assert setup(*tests) == ["build SKIP_CUDA=0"]
    assert (tmp_path / "fp8ops" / "_C.fake.so").exists()
    assert setup(*demo) == [] and setup(*tests) == [] and setup(*demo, gpu=True) == []
    (tmp_path / "csrc" / "a.cu").write_text("changed")
    assert setup(*demo, gpu=True) == ["build SKIP_CUDA=0"]
    (tmp_path / "csrc" / "step" / "b.cpp").write_text("changed")  # a source in a subfolder
    assert setup(*tests) == ["build SKIP_CUDA=0"]
