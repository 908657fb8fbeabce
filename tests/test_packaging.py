"""What an installed wheel holds: the bundled model, its dense control (the demo's second
column) and the C kernels' sources are package data, so `pip install .` then `kvstack demo`
works away from the repository."""
import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_file_the_package_reads_at_run_time_is_package_data():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["kvstack"]
    needed = [p for p in (ROOT / "kvstack" / "data").rglob("*") if p.is_file()]
    needed += [p for p in (ROOT / "kvstack" / "native").iterdir() if p.suffix in (".c", ".h")]
    for path in needed:
        relative = path.relative_to(ROOT / "kvstack").as_posix()
        assert any(fnmatch.fnmatch(relative, g) and relative.count("/") == g.count("/")
                   for g in globs), relative


def test_the_demo_reads_both_models_from_the_package():
    from kvstack.demo import BUNDLED_CONTROL
    from kvstack.engine.loading import bundled_model

    package = ROOT / "kvstack"
    for model in (bundled_model(), BUNDLED_CONTROL):
        assert model.resolve().is_relative_to(package)
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
            p.name for p in model.iterdir()}


def test_a_clone_directory_named_kvstack_does_not_shadow_the_package(tmp_path):
    """A script run beside a checkout directory called `kvstack` (the clone's default name)
    imports the package, not that directory as an empty namespace package."""
    import subprocess
    import sys

    (tmp_path / "kvstack").mkdir()
    done = subprocess.run([sys.executable, "-c", "import kvstack; print(kvstack.__file__)"],
                          cwd=tmp_path, capture_output=True, text=True, check=True)
    assert done.stdout.strip().endswith("__init__.py"), done.stdout
