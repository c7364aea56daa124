"""The kernel cache is whole or absent (CPU, fake compiler): concurrent processes build a missing
kernel once; a truncated or uncommitted library is rebuilt; one that fails to load is rebuilt
once, then ``BuildError`` (the backends' signal to fall back)."""

import ctypes
import os
import select
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cutlass_kernels import build, cache

REPO = Path(__file__).resolve().parents[2]


def _real_library() -> Path:
    import _ctypes

    path = getattr(_ctypes, "__file__", None)
    if not path:
        pytest.fail("_ctypes is built into this Python: the fake compiler needs a shared library to copy")
    return Path(path)


FAKE_NVCC = textwrap.dedent("""\
    #!{python}
    import os, shutil, sys, time
    if "--version" in sys.argv:
        print("Cuda compilation tools, fake 0.0")
        sys.exit(0)
    out = sys.argv[sys.argv.index("-o") + 1]
    with open(os.environ["FAKE_NVCC_LOG"], "a") as log:
        log.write(f"{{os.getpid()}} {{out}}\\n")
    time.sleep(float(os.environ.get("FAKE_NVCC_SECONDS", "0")))
    data = open({library!r}, "rb").read()
    if os.environ.get("FAKE_NVCC_GARBAGE"):
        data = b"\\x7fELF truncated"
    with open(out, "wb") as f:
        f.write(data)
""")


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    """CUDA_HOME with a fake nvcc that copies a real library; returns (cache dir, compile log)."""
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(FAKE_NVCC.format(python=sys.executable, library=str(_real_library())))
    nvcc.chmod(0o755)
    log = tmp_path / "compiles.log"
    log.touch()
    cache_root = tmp_path / "cache"
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("TE_DIST_CACHE", str(cache_root))
    monkeypatch.setenv("FAKE_NVCC_LOG", str(log))
    build.find_nvcc.cache_clear()
    yield cache_root, log
    build.find_nvcc.cache_clear()


@pytest.fixture
def source(tmp_path):
    src = tmp_path / "kernel.cu"
    src.write_text("extern \"C\" int te_fake(void) { return 0; }\n")
    return src


def _compiles(log: Path) -> int:
    return len(log.read_text().splitlines())


def test_concurrent_processes_build_a_missing_kernel_once(fake_nvcc, source):
    cache_root, log = fake_nvcc
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", FAKE_NVCC_SECONDS="1")
    script = "import sys; from pathlib import Path; from cutlass_kernels import build; " \
             "print(build.build_plain_source(Path(sys.argv[1])))"
    procs = [subprocess.Popen([sys.executable, "-c", script, str(source)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1, paths
    assert _compiles(log) == 1, log.read_text()
    path = Path(paths.pop())
    assert cache.entry_is_whole(path)
    ctypes.CDLL(str(path))
    leftovers = [p.name for p in cache_root.iterdir() if p.name.startswith(".")]
    assert not leftovers, f"temp build dirs left behind: {leftovers}"


def test_a_build_says_so_and_a_hit_is_silent(fake_nvcc, source, capsys):
    """A first-use build stalls its caller for about a minute: it names the kernel on stderr, before and after."""
    build.build_plain_source(source)
    err = capsys.readouterr().err
    assert f"te_dist: building kernel {source.stem} on first use" in err, err
    assert f"te_dist: built kernel {source.stem} in" in err, err
    build.build_plain_source(source)
    assert capsys.readouterr().err == ""


def test_a_process_waiting_for_another_build_says_so(fake_nvcc, source):
    """While another process holds the build lock, a caller says it waits (then builds once it may)."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    script = "import sys; from pathlib import Path; from cutlass_kernels import build; " \
             "print(build.build_plain_source(Path(sys.argv[1])))"
    with cache.try_locked(build._entry(source, source.stem)[0]) as held:  # this test is the other process's build
        assert held
        proc = subprocess.Popen([sys.executable, "-c", script, str(source)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        ready, _, _ = select.select([proc.stderr], [], [], 60)
        first = proc.stderr.readline() if ready else ""
    out, rest = proc.communicate(timeout=60)
    assert proc.returncode == 0, first + rest
    assert first.startswith("te_dist: waiting for another process building kernel"), first + rest
    assert "te_dist: building kernel" in rest, rest


def test_truncated_library_is_detected_and_rebuilt(fake_nvcc, source):
    _, log = fake_nvcc
    path = build.build_plain_source(source)
    whole = path.read_bytes()
    assert build.build_plain_source(source) == path and _compiles(log) == 1  # a hit: no second compile
    with open(path, "r+b") as f:  # a crash after the rename but before the bytes reached the disk
        f.truncate(len(whole) // 2)
    assert not cache.entry_is_whole(path)
    assert build.build_plain_source(source) == path
    assert _compiles(log) == 2 and path.read_bytes() == whole
    ctypes.CDLL(str(path))


def test_library_without_its_digest_is_absent(fake_nvcc, source):
    _, log = fake_nvcc
    path = build.build_plain_source(source)
    Path(str(path) + ".sha256").unlink()  # a crash between the library's rename and the commit
    assert build.build_plain_source(source) == path and _compiles(log) == 2


def test_library_that_fails_to_load_is_rebuilt_once(fake_nvcc, source):
    _, log = fake_nvcc
    opened = []

    def open_fn(path):
        opened.append(path)
        if len(opened) == 1:
            raise OSError("undefined symbol")  # e.g. a library whose bytes are whole but stale
        return ctypes.CDLL(str(path))

    build.open_plain_source(source, open_fn)
    assert len(opened) == 2 and _compiles(log) == 2


def test_library_that_fails_to_load_after_a_rebuild_raises_build_error(fake_nvcc, source, monkeypatch):
    _, log = fake_nvcc
    monkeypatch.setenv("FAKE_NVCC_GARBAGE", "1")  # the compiler itself emits a library dlopen rejects
    with pytest.raises(build.BuildError, match="even after a rebuild"):
        build.open_plain_source(source, lambda path: ctypes.CDLL(str(path)))
    assert _compiles(log) == 2  # rebuilt once, not in a loop


def test_failed_compile_leaves_no_entry(fake_nvcc, source, monkeypatch):
    cache_root, _ = fake_nvcc
    monkeypatch.setenv("FAKE_NVCC_LOG", str(cache_root / "missing-dir" / "log"))  # the fake compiler fails
    with pytest.raises(build.BuildError, match="nvcc failed"):
        build.build_plain_source(source)
    assert not [p for p in cache_root.iterdir() if p.suffix in (".so", ".sha256") or p.name.startswith(".")]


def test_a_plain_sources_key_covers_the_headers_beside_it_that_it_includes(fake_nvcc, tmp_path):
    """Editing a header a plain source includes by a quoted name gives a new cache entry (the cast sources share
    cast_fp8_common.cuh); a header it does not include, or a system header, leaves the key as it was."""
    src = tmp_path / "two.cu"
    (tmp_path / "shared.cuh").write_text("#pragma once\nconstexpr int kA = 1;\n")
    (tmp_path / "other.cuh").write_text("constexpr int kB = 2;\n")
    src.write_text('#include <stdint.h>\n  #  include "shared.cuh"\nextern "C" int te_fake(void) { return kA; }\n')
    first = build.build_plain_source(src)
    (tmp_path / "other.cuh").write_text("constexpr int kB = 3;\n")
    assert build.build_plain_source(src) == first
    (tmp_path / "shared.cuh").write_text("#pragma once\nconstexpr int kA = 2;\n")
    second = build.build_plain_source(src)
    assert second != first and second.name.startswith("two-")

