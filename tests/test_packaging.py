"""What a user downloads: the wheel (``pip install <repository>``) and ComfyUI's registry archive.

The wheel holds the ``tome_core`` package and nothing else, with no dependency to install; the registry archive
(``comfy node pack``, as a publisher runs it, with the repository's ``.comfyignore``) holds what ComfyUI loads and
none of the lab, and ComfyUI loads it as a custom node package. Both stay under ``MAX_BYTES``. Each is built from
a copy of the checkout's tracked files, in a subprocess, so the source tree gets no build folders.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_BYTES = 2 * 2**20  # what a node or a wheel of this size of code should weigh (the lab stays in the repository)
COMFY_CLI = ROOT / ".venv-pack" / "bin" / "comfy"


def tracked_copy(target: Path) -> Path:
    """The checkout's tracked files as they are now (uncommitted edits included), in a fresh git repository."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    subprocess.run(["git", "init", "-q"], cwd=target, check=True)
    subprocess.run(["git", "add", "-A"], cwd=target, check=True)
    return target


def test_wheel_holds_only_tome_core_and_requires_nothing(tmp_path):
    source = tracked_copy(tmp_path / "checkout")
    out = tmp_path / "wheel"
    out.mkdir()
    build = f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", build], cwd=source, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = out / done.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    packaged = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert packaged == {"tome_core"}
    modules = {name for name in names if name.endswith(".py")}
    expected = {str(path.relative_to(ROOT)).replace("\\", "/") for path in (ROOT / "tome_core").rglob("*.py")}
    assert modules == expected  # every engine and adapter module, and nothing of the hosts' front ends
    assert "Requires-Dist" not in metadata  # never pulls torch (or anything) over a host's own build
    assert wheel.stat().st_size < MAX_BYTES


@pytest.fixture(scope="module")
def registry_archive(tmp_path_factory) -> Path:
    """ComfyUI's registry archive of this checkout, built by comfy-cli (``.venv-pack``, made by setup_env.sh)."""
    if not COMFY_CLI.exists():
        pytest.fail("comfy-cli is missing: run tools/setup_env.sh (it makes .venv-pack)")
    source = tracked_copy(tmp_path_factory.mktemp("registry") / "checkout")
    home = tmp_path_factory.mktemp("home")  # comfy-cli's own settings go there, not into the user's
    env = dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"))
    command = [str(COMFY_CLI), "--skip-prompt", "--no-enable-telemetry", "node", "pack"]
    done = subprocess.run(command, cwd=source, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return source / "node.zip"


def test_the_registry_archive_holds_the_node_and_none_of_the_lab(registry_archive):
    with zipfile.ZipFile(registry_archive) as archive:
        names = set(archive.namelist())
    tops = {name.split("/")[0] for name in names}
    for needed in ("__init__.py", "nodes.py", "pyproject.toml", "LICENSE", "README.md", "web/saved_defaults.js"):
        assert needed in names, needed
    engine = {str(path.relative_to(ROOT)).replace("\\", "/") for path in (ROOT / "tome_core").rglob("*.py")}
    assert engine <= names  # the whole engine and every host door
    assert not tops & {"tools", "tests", "docs", "scripts", "requirements", ".ci", "install.py"}
    assert not any(name.endswith(".safetensors") for name in names)  # no reference weights
    assert registry_archive.stat().st_size < MAX_BYTES


def test_comfyui_loads_the_registry_archive(registry_archive, tmp_path):
    """The archive unpacked into a custom_nodes folder loads with ComfyUI's own loader and offers the node (in a
    process of its own: the test process has this checkout loaded under another name)."""
    folder = tmp_path / "custom_nodes" / "ToMe-Patch"
    with zipfile.ZipFile(registry_archive) as archive:
        archive.extractall(folder)
    script = f"""
import asyncio, sys
sys.path.insert(0, {str(ROOT / "tests")!r}); sys.path.insert(1, {str(ROOT)!r})
from hosts import comfy_host as host
nodes = host.comfy_nodes
assert asyncio.run(nodes.load_custom_node({str(folder)!r}, module_parent="custom_nodes"))
node = nodes.NODE_CLASS_MAPPINGS["ToMePatch"]
assert node.__module__.endswith("ToMe-Patch.nodes"), node.__module__
print("loaded", node.__module__)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "loaded" in done.stdout
