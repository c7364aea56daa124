"""Build check: compile the CUDA sources with nvcc against the nvidia-cutlass headers (no GPU needed).

Skipped only when nvcc is absent. One full JIT build per CUTLASS source (bf16 forward, FP8 wgrad:
key, temp dir, rename, exported symbols) and the device code of the other bf16 directions and the
fp32 output (PTX only), all compiled at once: a full build of one instance takes ~2 minutes of one
core here, and the GPU runs build every instance ahead of time anyway (python -m cutlass_kernels).
"""

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

import cutlass_kernels as ck
from cutlass_kernels import build

pytestmark = pytest.mark.slow

BUILT = ck.Instance("fwd", 0, False)  # a full build
DEVICE_CODE = [ck.Instance("dgrad", 1, True), ck.Instance("wgrad", 1, False)]  # PTX only


def test_cache_key_covers_instance_and_flags(monkeypatch, tmp_path):
    if ck.find_nvcc() is None or ck.find_cutlass() is None:
        pytest.skip("nvcc or the nvidia-cutlass headers are absent: the cache key needs both")
    def key(inst, flags=build.BASE_FLAGS):  # the cache entry's name holds the key
        return build._entry(build.SOURCE, inst.name, inst.macros, flags)[0].name

    keys = {key(i) for i in build.all_instances()}
    assert len(keys) == len(build.all_instances())
    assert key(BUILT) in keys
    assert key(BUILT, build.BASE_FLAGS + ("-DEXTRA",)) not in keys
    monkeypatch.setenv("TE_DIST_CACHE", str(tmp_path))
    assert build.cache_dir() == tmp_path


def test_instance_validation():
    with pytest.raises(ValueError, match="direction"):
        ck.Instance("bwd", 0)
    with pytest.raises(ValueError, match="config"):
        ck.Instance("fwd", 99)


def test_fp8_instance_names_and_validation():
    from cutlass_kernels.fp8_block import FP8_CONFIGS, Fp8Instance, all_fp8_instances, choose_fp8_config

    inst = Fp8Instance("wgrad", 0, a_format="e5m2")
    assert inst.name == "te_fb_wgrad_c0_e5m2xe4m3_bf16"
    assert "-DTE_FB_KIND=2" in inst.macros and "-DTE_FB_A_E5M2=1" in inst.macros
    assert {i.direction for i in all_fp8_instances()} == {"fwd", "dgrad", "wgrad"}
    assert choose_fp8_config("wgrad", 64, 8) == 11 and choose_fp8_config("fwd", 64 * 8, 8) == 1
    with pytest.raises(ValueError, match="a_format"):
        Fp8Instance("fwd", 0, a_format="e2m1")
    with pytest.raises(ValueError, match="config"):
        Fp8Instance("fwd", 99)
    with pytest.raises(ValueError, match="does not fit fwd with block scales"):  # a 192-wide tile splits weight blocks
        Fp8Instance("fwd", 3)
    for config, (schedule, *_rest) in FP8_CONFIGS.items():  # fast accumulation: tensor-scaled fwd only
        if schedule.endswith("_fast"):
            assert Fp8Instance("fwd", config, tensor_scales=True).macros
            for direction, tensor in (("fwd", False), ("dgrad", True), ("wgrad", True)):
                with pytest.raises(ValueError, match=f"does not fit {direction}"):
                    Fp8Instance(direction, config, a_format="e4m3", tensor_scales=tensor)
    assert Fp8Instance("wgrad", 3).name == "te_fb_wgrad_c3_e4m3xe4m3_bf16"
    # per-tensor scales: their own instances, and any tile (no weight scale blocks to cover)
    tensor = Fp8Instance("fwd", 3, tensor_scales=True)
    assert tensor.name == "te_fb_fwd_c3_e4m3xe4m3_bf16_tensor" and "-DTE_FB_TENSOR_SCALES=1" in tensor.macros
    assert "-DTE_FB_TENSOR_SCALES=0" in inst.macros
    built = {(i.direction, i.a_format, i.tensor_scales) for i in all_fp8_instances()}
    assert {("wgrad", "e5m2", True), ("dgrad", "e5m2", True), ("fwd", "e4m3", True), ("fwd", "e4m3", False)} <= built


def test_the_wgrad_tile_is_config_0_with_a_wider_epilogue_alone():
    """Config 11, every wgrad's tile, is config 0 with a 128 x 64 epilogue sub-tile (TE_FB_EPI_N; 0 = CUTLASS's pick,
    128 x 32): the same macros otherwise, so its A/B against 0 times the epilogue alone. The default builds hold it
    for wgrad alone, and the rule picks it for every wgrad and nowhere else."""
    import itertools

    from cutlass_kernels import heuristics as h
    from cutlass_kernels.fp8_block import Fp8Instance, all_fp8_instances

    assert h.FP8_WGRAD_CONFIG == 11
    cand, base = Fp8Instance("wgrad", 11, "e5m2", tensor_scales=True), Fp8Instance("wgrad", 0, "e5m2",
                                                                                   tensor_scales=True)
    differ = set(cand.macros) ^ set(base.macros)
    assert differ == {"-DTE_FB_CONFIG=11", "-DTE_FB_CONFIG=0", "-DTE_FB_EPI_N=64", "-DTE_FB_EPI_N=0"}
    assert cand.name == "te_fb_wgrad_c11_e5m2xe4m3_bf16_tensor"
    for inst in all_fp8_instances():
        assert (inst.config == 11) == (inst.direction == "wgrad"), inst.name
        assert ("-DTE_FB_EPI_N=64" in inst.macros) == (inst.config == 11), inst.name
    for d, rows, groups, tensor, fast in itertools.product(("fwd", "dgrad", "wgrad"), (1, 512, 8192, 1 << 17), (1, 8, 64),
                                                           (False, True), (False, True)):
        tile = h.fp8_config(d, rows, groups, tensor_scales=tensor, fast=fast, contraction=7168, columns=2048)
        assert tile == 11 if d == "wgrad" else tile in (0, 1, 3, 7, 8)


def test_build_cli_names_every_instance_it_can_build_and_refuses_others(capsys, monkeypatch, tmp_path):
    """``--only`` takes any recipe's instance, candidate tiles included, and a name it cannot build is
    an error before anything is compiled (it used to be dropped silently)."""
    from cutlass_kernels.__main__ import main
    from cutlass_kernels.fp8_block import FP8_CONFIGS, fp8_candidate_instances

    names = {i.name for i in fp8_candidate_instances()}
    for config in FP8_CONFIGS:
        wgrad = f"te_fb_wgrad_c{config}_e5m2xe4m3_bf16_tensor" in names and f"te_fb_wgrad_c{config}_e4m3xe4m3_bf16" in names
        assert wgrad == (not FP8_CONFIGS[config][0].endswith("_fast"))  # fast accumulation: tensor-scaled fwd only
        assert f"te_fb_fwd_c{config}_e4m3xe4m3_bf16_tensor" in names
    monkeypatch.setenv("TE_DIST_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        main(["--only", "te_fb_wgrad_c0_e4m3xe4m3_bf16", "te_fb_wgrad_c9_e4m3xe4m3_bf16"])
    assert exc.value.code == 2
    assert "no such instance: te_fb_wgrad_c9_e4m3xe4m3_bf16" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.so"))


def _full_build(inst, tmp_path):
    """A JIT build into ``tmp_path``: the library, and a second call that is a cache hit."""
    path = ck.build_instance(inst)
    assert path.exists() and path.stat().st_size > 100_000
    assert path.parent == tmp_path
    mtime = path.stat().st_mtime_ns
    assert ck.build_instance(inst) == path and path.stat().st_mtime_ns == mtime
    return path


def _fp8_build(tmp_path, inst):
    """An FP8 kernel instance: the block-scaled wgrad (1x1x128 scale granularity, an e5m2 operand), and the
    tensor-scaled wgrad that adds into its output (its epilogue reads the output as its source)."""
    from cutlass_kernels.fp8_block import build_fp8_instance

    path = build_fp8_instance(inst)
    assert path.exists() and path.parent == tmp_path
    symbols = subprocess.run(["nm", "-D", str(path)], capture_output=True, text=True, check=True).stdout
    for name in ("te_fb_run", "te_fb_workspace_bytes", "te_fb_kind", "te_fb_formats", "te_fb_last_error"):
        assert f" T {name}" in symbols, name
    return path


def _compile_device_code(inst, out):
    """``inst``'s device code compiled to PTX only (no ptxas, no host code, no cache): a check that an
    instance's templates instantiate, in about half the time of a full build."""
    nvcc, (include, util, _) = build.find_nvcc(), build.find_cutlass()
    cmd = [nvcc, "-arch=compute_90a", "--ptx", *build.DEVICE_FLAGS, *inst.macros, f"-I{include}", f"-I{util}",
           "-o", str(out), str(build.SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"nvcc failed on the device code of {inst.name}:\n{proc.stderr[-4000:]}"
    return out


@pytest.mark.skipif(shutil.which("nvcc") is None and build.find_nvcc() is None,
                    reason="nvcc is absent on this machine (the .cu build check needs the CUDA compiler)")
@pytest.mark.timeout(1800)
def test_nvcc_compiles_every_cutlass_source_and_direction(tmp_path, monkeypatch):
    if ck.find_cutlass() is None:
        pytest.fail("nvcc is present but the CUTLASS headers are not: pip install --no-deps nvidia-cutlass")
    monkeypatch.setenv("TE_DIST_CACHE", str(tmp_path))
    from cutlass_kernels.fp8_block import Fp8Instance

    jobs = {BUILT.name: lambda: _full_build(BUILT, tmp_path),
            "fp8 wgrad e5m2": lambda: _fp8_build(tmp_path, Fp8Instance("wgrad", 0, a_format="e5m2")),
            "fp8 wgrad accumulating": lambda: _fp8_build(tmp_path, Fp8Instance("wgrad", 0, tensor_scales=True,
                                                                               accumulate=True))}
    for inst in DEVICE_CODE:
        jobs[f"{inst.name} (device code)"] = lambda inst=inst: _compile_device_code(inst, tmp_path / f"{inst.name}.ptx")
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:  # each nvcc is one process: they overlap
        futures = {name: pool.submit(job) for name, job in jobs.items()}
    failed = {name: f.exception() for name, f in futures.items() if f.exception() is not None}
    assert not failed, "\n".join(f"{name}: {exc}" for name, exc in failed.items())
    for inst in DEVICE_CODE:
        ptx = (tmp_path / f"{inst.name}.ptx").read_text()
        assert ".entry" in ptx and "sm_90a" in ptx, f"{inst.name}: no kernel entry in its PTX"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp build dir left behind"
