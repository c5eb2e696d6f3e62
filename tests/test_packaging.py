"""``pip install <repository>`` gives the ``tome_core`` package and nothing else, with no dependency to install.

The wheel is built by the project's own build backend (setuptools, as ``pyproject.toml`` names it) from a copy of
the files a checkout has, in a subprocess, so the source tree gets no build folders.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_holds_only_tome_core_and_requires_nothing(tmp_path):
    source = tmp_path / "checkout"
    ignore = shutil.ignore_patterns(".venv*", ".git", "__pycache__", "results", "build", "*.egg-info")
    shutil.copytree(ROOT, source, ignore=ignore)
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
