"""AUTOMATIC1111 WebUI / Forge script "ToMe Patch": token merging (ToMe) and token downsampling (ToDo).

The WebUI imports every ``.py`` in ``scripts/`` as a script, with the extension folder on ``sys.path`` only while
loading, so the helper package ``tome_core`` is imported here at the top. Nothing from ``ldm``, ``sgm`` or gradio
is imported at module level (Forge has no ``ldm``/``sgm``; gradio is only needed to build the UI).

Job order in WebUI v1.10.1 (modules/processing.py): ``before_process`` -> built-in token merging applied -> ``process``
-> ``process_before_every_sampling`` per pass (the first pass, then the highres pass with ``p.is_hr_pass`` set, after
the built-in applied its highres ratio; img2img's) -> ``postprocess`` (not in a ``finally``) -> built-in removed in a
``finally``. Every script hook is wrapped in a try/except that only prints (modules/scripts.py), so nothing here may
rely on an exception reaching the user: bad input is reported in one console line and the job runs unpatched.

What each pass gets is decided by the WebUI's front door, ``tome_core/hosts/webui/patch.py``; this file keeps the script
class, its UI glue (paste-back, the X/Y/Z plot's axes) and the WebUI's callbacks.
"""

from __future__ import annotations

from modules import script_callbacks, scripts

from tome_core.hosts.webui import args as webui_args
from tome_core.hosts.webui import calibrate as webui_calibrate
from tome_core.hosts.webui import layer_reuse as webui_layer_reuse
from tome_core.hosts.webui.patch import (
    JOB,
    OVERRIDES,
    TITLE,
    end_job,
    patch_for_pass,
    remove_everywhere,
    start_job,
)


class ToMePatchScript(scripts.Script):
    def title(self):
        return TITLE

    def show(self, is_img2img):
        return scripts.AlwaysVisible

    def ui(self, is_img2img):
        from tome_core.hosts.webui.ui import build_ui  # gradio only here

        components = build_ui(self, is_img2img)
        self.infotext_fields = _infotext_fields(components)
        self.paste_field_names = list(webui_args.INFOTEXT_KEYS)
        return components

    def before_process(self, p, *args):
        remove_everywhere(getattr(p, "sd_model", None))
        start_job(p, args)

    def process_before_every_sampling(self, p, *args, **kwargs):
        job = getattr(p, JOB, None) or start_job(p, args)
        try:
            patch_for_pass(p, job, kwargs.get("x"))
        except Exception as err:  # never leave a half-applied patch behind, never stop the generation
            remove_everywhere(getattr(p, "sd_model", None))
            job.warn_once(f"not applied because of an error: {err!r}")

    def postprocess(self, p, processed, *args):
        job = getattr(p, JOB, None)
        end_job(p, job)
        remove_everywhere(getattr(p, "sd_model", None))
        # A job that calibrated, with "Show the calibration's picture" ticked: the picture after the job's images.
        webui_calibrate.show_picture(job, processed)


def _infotext_fields(components):
    """Paste-back: each control gets a callable of the parsed parameters (a missing value means no change)."""
    fields = []
    for component, name in zip(components, webui_args.ARG_NAMES, strict=True):

        def read(params, name=name):
            return webui_args.ui_values_from_infotext(params).get(name)

        fields.append((component, read))
    return fields


# --- X/Y/Z plot ---------------------------------------------------------------------------------------------------


def _xyz_apply(name):
    def apply(p, value, values):
        overrides = dict(getattr(p, OVERRIDES, None) or {})
        overrides[name] = value
        setattr(p, OVERRIDES, overrides)

    return apply


def add_xyz_axes() -> bool:
    """Add our axes to the X/Y/Z plot script if it is loaded (it is a script like ours, so look it up)."""
    xyz = next(
        (data.module for data in getattr(scripts, "scripts_data", []) if data.script_class.__module__ == "xyz_grid.py"),
        None,
    )
    if xyz is None:
        return False
    labels = {option.label for option in xyz.axis_options}
    new_axes = [
        xyz.AxisOption(
            f"[{TITLE}] Method",
            str,
            _xyz_apply("method"),
            choices=lambda: list(webui_args.METHOD_LABELS.values()),
        ),
        xyz.AxisOption(f"[{TITLE}] Ratio", float, _xyz_apply("ratio")),
        xyz.AxisOption(f"[{TITLE}] Downsample factor", float, _xyz_apply("downsample_factor")),
        xyz.AxisOption(
            f"[{TITLE}] Scope",
            str,
            _xyz_apply("scope"),
            choices=lambda: list(webui_args.ARGS[webui_args.ARG_NAMES.index("scope")].choices),
        ),
        xyz.AxisOption(f"[{TITLE}] Reuse interval", int, _xyz_apply("reuse_interval")),
        xyz.AxisOption(
            f"[{TITLE}] Reuse plan",
            str,
            _xyz_apply("reuse_plan"),
            choices=lambda: list(webui_args.ARGS[webui_args.ARG_NAMES.index("reuse_plan")].choices),
        ),
        xyz.AxisOption(f"[{TITLE}] Calibration target", float, _xyz_apply("calibration_target")),
    ]
    xyz.axis_options.extend(axis for axis in new_axes if axis.label not in labels)
    return True


script_callbacks.on_model_loaded(remove_everywhere)
script_callbacks.on_script_unloaded(remove_everywhere)
script_callbacks.on_before_ui(add_xyz_axes)
# The step of each model call, for reuse across steps (modules/script_callbacks.py, v1.10.1 and Forge).
script_callbacks.on_cfg_denoiser(webui_layer_reuse.on_cfg_denoiser)
script_callbacks.on_cfg_after_cfg(webui_layer_reuse.on_cfg_after_cfg)
# The denoised image per step of a calibration's unpatched run (its picture's chart).
script_callbacks.on_cfg_denoiser(webui_calibrate.on_cfg_denoiser)
script_callbacks.on_cfg_after_cfg(webui_calibrate.on_cfg_after_cfg)
