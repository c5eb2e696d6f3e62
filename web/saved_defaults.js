// ToMe Patch: a workflow saved before an input of the node existed keeps the picture it was saved with.
//
// The front end restores a node's widget values by position and leaves widgets past the saved ones at their
// current defaults. reuse_interval was added after the first inputs, with 1 (off), and its default is 3 now: a
// workflow whose saved values stop before it meant 1, so it gets 1 back here (as the server side does for an API
// prompt that leaves it out: tome_core/settings.py, IMPLIED_WHEN_ABSENT). dit_settings came later still: a
// workflow saved before it ran a DiT with its inputs as set ("as set"; "auto" is the default now). reuse_plan
// came last: a workflow saved before it reused one UNet step in N ("every N"; "forecast v3" is the default now, and a
// workflow saved with "forecast" or "auto" stores it among its values). A node added anew keeps the defaults.
import { app } from "../../scripts/app.js";

const NODES = new Set(["ToMePatch", "ToMePatchAdvanced"]);
const IMPLIED_WHEN_ABSENT = { reuse_interval: 1, dit_settings: "as set", reuse_plan: "every N" };

app.registerExtension({
  name: "tome_patch.saved_defaults",
  beforeRegisterNodeDef(nodeType, nodeData) {
    if (!NODES.has(nodeData.name)) return;
    const configure = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function (info) {
      const result = configure?.apply(this, arguments);
      const saved = info?.widgets_values;
      if (Array.isArray(saved) && this.widgets) {
        for (const [name, value] of Object.entries(IMPLIED_WHEN_ABSENT)) {
          const index = this.widgets.findIndex((w) => w.name === name);
          if (index >= saved.length) this.widgets[index].value = value;
        }
      }
      return result;
    };
  },
});
