"""docs/writing-a-backend.md's wiring of the torch plugin (``AdapterHooks``), executed: the
guide's block, run as a plugin module, claims the reference layer and answers its layer spec
as the shipped plugin does (``tests/core/test_doc_snippets.py`` registers it with the core)."""

from __future__ import annotations

import re
import types
from pathlib import Path

from cases import layer_config

from hp_cp_torch.adapter import ReferenceLayerAdapter
from hp_cp_torch.backend import TorchBackend
from hp_cp_torch.reference import DeepSeekV4Attention

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "writing-a-backend.md"
BLOCK = re.compile(
    r"<!-- snippet: hp_cp_torch/src/hp_cp_torch/_plugin.py -->\n```python\n(.*?)```", re.S
)


def test_the_guides_torch_wiring_runs_the_hooks_on_a_layer() -> None:
    block = BLOCK.search(GUIDE.read_text(encoding="utf-8"))
    assert block, "docs/writing-a-backend.md shows no hp_cp_torch/_plugin.py"
    plugin = types.ModuleType("guide_plugin")
    exec(compile(block.group(1), "guide", "exec"), vars(plugin))
    layer = DeepSeekV4Attention(layer_config(4))
    assert plugin.hp_cp_layer_spec(layer) == ReferenceLayerAdapter(layer).layer_spec()
    assert isinstance(plugin.hp_cp_backend(layer), TorchBackend)
    assert plugin.find_layers(layer) == [layer]
    assert plugin.hp_cp_layer_spec(object()) is None  # a module it does not own
