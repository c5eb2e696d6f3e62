"""ComfyUI custom node package "ToMe Patch".

ComfyUI imports this file from ``custom_nodes/<folder>/__init__.py``. With the V3 node API (``comfy_api``)
present it offers ``comfy_entrypoint``; on older ComfyUI the classic ``NODE_CLASS_MAPPINGS``. Only one of the
two may exist: ComfyUI never looks at the entrypoint when the mappings are there.

Imported as a lone module rather than as a package (pytest does that with the repository's folder when its name
is not a Python identifier, such as ``ComfyUI-ToMe-Patch``), there is no ComfyUI to register with: it defines
nothing.
"""

if __package__:
    # The front end's part (web/saved_defaults.js): a workflow saved before an input existed keeps its picture.
    WEB_DIRECTORY = "./web"

    try:
        from comfy_api.latest import ComfyExtension
    except ImportError:  # ComfyUI before the V3 API
        ComfyExtension = None

    if ComfyExtension is not None:
        from .nodes import v3_nodes

        class ToMePatchExtension(ComfyExtension):
            async def get_node_list(self):
                return v3_nodes()

        async def comfy_entrypoint():
            return ToMePatchExtension()

    else:
        from .nodes import (
            ADVANCED_NODE_ID,
            NODE_ID,
            REPORT_NODE_ID,
            ClassicToMeCalibrationReport,
            ClassicToMePatch,
            ClassicToMePatchAdvanced,
        )

        NODE_CLASS_MAPPINGS = {
            NODE_ID: ClassicToMePatch,
            ADVANCED_NODE_ID: ClassicToMePatchAdvanced,
            REPORT_NODE_ID: ClassicToMeCalibrationReport,
        }
        NODE_DISPLAY_NAME_MAPPINGS = {
            NODE_ID: "ToMe Patch",
            ADVANCED_NODE_ID: "ToMe Patch (Advanced)",
            REPORT_NODE_ID: "ToMe Calibration Report",
        }
