"""A regular (non-editable) install maps core/ -> llmserve and plugins/ -> llmserve.plugins too."""

import subprocess
import sys
import sysconfig

from conftest import ROOT


def test_wheel_install_imports_kernel_and_plugins(tmp_path):
    wheel_dir, site = tmp_path / "wheels", tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", str(wheel_dir), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    wheel = next(wheel_dir.glob("llmserve-*.whl"))
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                              "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    # -S: no .pth files, so the editable install's import hook is out of the way; the venv's
    # packages are still on the path for pluggy & co.
    code = ("import llmserve, llmserve.plugins.protocols.openai, llmserve.engine.engine, importlib.metadata as md;"
            "print(llmserve.__file__); print(llmserve.plugins.__file__);"
            "print(sorted(e.name for e in md.entry_points(group='llmserve') if e.dist.name == 'llmserve'))")
    env = {"PYTHONPATH": f"{site}:{sysconfig.get_paths()['purelib']}"}
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    core_file, plugins_file, eps = out.stdout.splitlines()
    assert core_file == str(site / "llmserve" / "__init__.py")
    assert plugins_file == str(site / "llmserve" / "plugins" / "__init__.py")
    # The native kernel's source ships with the wheel: it is compiled on the user's machine.
    csrc = site / "llmserve" / "plugins" / "backends" / "torch" / "native" / "csrc"
    for source in ("paged_decode.c", "packed_linear.c", "elementwise.c", "decoder_step.c", "vec_math.h"):
        assert (csrc / source).is_file(), source
    assert {"openai", "tgi", "triton", "mindie", "torch", "ops"} <= set(eval(eps))
